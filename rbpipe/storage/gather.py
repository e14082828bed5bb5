"""Concatenate whole stored blocks (groups) column by column with one multi-threaded copy.

Why: sampling whole LLM groups means copying scattered ranges per field into one tensor per field. numpy copies them on
one core; torchrl's ``LazyMemmapStorage`` gathers its padded rows with torch's OpenMP threads. This module copies every
range of every column in one parallel loop (a numba ``prange`` on numba's OpenMP layer, whose workers keep spinning
between calls, so a sample every few hundred microseconds does not pay a thread wake-up each time: on small VMs a
sleeping pool's wake-up cost more than the copy saves; figures: docs/DESIGN.md, Figures behind code choices).

The numpy path (one ``np.concatenate`` per field) is used instead when the process runs torch on one thread
(one copy thread: numpy copies as fast, and importing numba's kernels would only lengthen a learner's
start-up; figures: docs/DESIGN.md, Figures behind code choices), when numba is not installed, when numba ended
up on its ``workqueue`` layer (sleeping workers), in a forked child of the process that started the threads
(GNU OpenMP is not fork-safe), and when ``RBPIPE_PARALLEL_GATHER=0``. Both paths return the same
bytes (``tests/storage/test_gather.py``). ``pad_ragged`` fills the rows of ``ragged_layout="padded"`` reads
the same way.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from rbpipe.errors import ConfigError

CHUNK_BYTES = 1 << 15  # one task of the parallel loop: balances 2+ cores on ~1 MB samples
MAX_THREADS = 8  # a sample is a few MB: more threads only add synchronisation
ENV = "RBPIPE_PARALLEL_GATHER"

_lock = threading.Lock()
_state: dict = {"pid": None, "kernels": None, "numba": None}


def _env_enabled() -> bool:
    raw = os.environ.get(ENV, "1").strip().lower()
    if raw in ("1", "true", "yes", "on", ""):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{ENV}={raw!r} is not understood: use 1 (parallel copies, the default) or 0 (numpy)")


def _kernels():
    """The kernels module, imported and warmed once per process; None where the parallel path is off."""
    if not _env_enabled() or torch.get_num_threads() < 2:
        return None
    if _state["pid"] != os.getpid():
        _load()
    return _state["kernels"]


def _load() -> None:
    with _lock:
        if _state["pid"] is None:
            kernels: ModuleType | None = None
            torch_threads = torch.get_num_threads()
            try:
                import numba

                import rbpipe.storage._kernels as loaded
                one = np.zeros((1, 2), np.int64)
                loaded.gather_arrays(one, CHUNK_BYTES)  # compile, or load the on-disk cache
                loaded.whole_group_positions(one[0], one[0], one[0])
                loaded.pad_rows(one[0].view(np.uint8), one[0, :1], one.view(np.uint8))
                kernels = None if numba.threading_layer() == "workqueue" else loaded
                _state["numba"] = numba
            except ImportError:  # numba not installed: numpy, as documented
                kernels = None
            except Exception as err:  # e.g. no writable cache directory for the compiled kernels
                warnings.warn(f"rbpipe reads whole groups with numpy (one core): numba's parallel copy could not "
                              f"start ({type(err).__name__}: {err}). Set NUMBA_CACHE_DIR to a writable directory, "
                              f"or {ENV}=0 to silence this.", RuntimeWarning, stacklevel=3)
                kernels = None
            finally:
                # starting numba's OpenMP pool raises the process's OpenMP thread count (torch's too) to every
                # core: a worker that chose 1 thread (it shares the cores with others) keeps its choice
                if torch.get_num_threads() != torch_threads:
                    torch.set_num_threads(torch_threads)
            _state["kernels"] = kernels
        else:  # a forked child: the parent's OpenMP threads do not exist here
            _state["kernels"] = None
        _state["pid"] = os.getpid()


def parallel_available() -> bool:
    """True when whole groups are copied on several threads in this process (see the module doc)."""
    return _kernels() is not None


def whole_groups(rows: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray | None:
    """Positions of the groups (``starts``/``stops`` of live groups) that ``rows`` lists whole and in row
    order, or None when ``rows`` is anything else or the parallel path is off."""
    kernels = _kernels()
    if kernels is None or not rows.size:
        return None
    if not (rows.flags.c_contiguous and rows.flags.writeable):  # the compiled signature: no new compile
        rows = rows.copy()
    found = kernels.whole_group_positions(rows, starts, stops)
    return found if found.size else None


def _ranges(columns: Sequence, table: dict) -> np.ndarray | None:
    """Addresses then byte counts of every array of one decoded block, in column order (a ragged column
    gives its flat values, then its shapes); None when one of them is not contiguous."""
    arrays: list[np.ndarray] = []
    for c in columns:
        if c.ragged:
            values, _, shapes = table[c.key]
            arrays += (values, shapes)
        else:
            arrays.append(table[c.key])
    if not all(a.flags.c_contiguous for a in arrays):
        return None
    return np.array([a.ctypes.data for a in arrays] + [a.nbytes for a in arrays], np.int64)


def concat_tables(columns: Sequence, tables: Sequence[dict], rows: int) -> dict | None:
    """Every column of whole decoded blocks (fixed columns as ``[n, *shape]`` arrays, ragged ones as
    ``(flat values, offsets, shapes)``), concatenated in the order given, as ``GroupStorage._gather_rows``
    returns columns: fixed ones as one array, ragged ones as a one-part list ``[(values, shapes)]``.

    Returns None (the caller concatenates with numpy) when the parallel path is off. Each block's
    addresses are computed once and kept in its table under ``"__ranges__"``: the table owns the arrays,
    so the addresses live exactly as long as the memory they point to, and the caller holds the tables
    for the duration of the copy."""
    kernels = _kernels()
    if kernels is None:
        return None
    plans = []
    for table in tables:
        plan = table.get("__ranges__", False)
        if plan is False:
            plan = table["__ranges__"] = _ranges(columns, table)
        if plan is None:
            return None
        plans.append(plan)
    _use_torch_threads()
    buf, starts, sizes = kernels.gather_arrays(np.stack(plans), CHUNK_BYTES)
    views = iter([buf[s:s + n] for s, n in zip(starts.tolist(), sizes.tolist(), strict=True)])
    out: dict = {}
    for c in columns:
        if c.ragged:
            values, shapes = next(views).view(c.np_dtype), next(views).view(np.int64).reshape(rows, c.ndim)
            out[c.key] = [(values, shapes)]
        else:
            out[c.key] = next(views).view(c.np_dtype).reshape(rows, *c.shape, *((2,) if c.complex else ()))
    return out


def pad_ragged(values: np.ndarray, lengths: np.ndarray, row_shape: tuple, out_dtype: np.dtype
               ) -> np.ndarray | None:
    """Rows of a 1-D ragged field (flat ``values``, one length per row) right-padded with zeros into a new
    ``[rows, longest, *row_shape]`` array, rows copied in parallel; None when the parallel path is off."""
    kernels = _kernels()
    if kernels is None:
        return None
    _use_torch_threads()
    width = int(lengths.max()) if lengths.size else 0
    out = np.empty((len(lengths), width, *row_shape), out_dtype)
    if out.size == 0:
        return out
    item = out.itemsize * int(np.prod(row_shape, dtype=np.int64))
    if values.nbytes != int(lengths.sum()) * item:  # the kernel does not bounds-check: refuse a mismatch
        raise ValueError(f"ragged values hold {values.nbytes} bytes, their row lengths say {int(lengths.sum()) * item}")
    kernels.pad_rows(np.ascontiguousarray(values).reshape(-1).view(np.uint8), lengths * item,
                     out.reshape(len(lengths), -1).view(np.uint8))
    return out


def _use_torch_threads() -> None:
    """As many copy threads as torch uses for its own CPU ops (at most ``MAX_THREADS``)."""
    numba = _state["numba"]
    want = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS, MAX_THREADS))
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)
