"""Concatenate whole stored blocks (groups) column by column with one multi-threaded copy.

Why: sampling 16 whole LLM groups means copying ~20 scattered ranges per field (1-2 MB) into one tensor
per field. numpy copies them on one core; torchrl's ``LazyMemmapStorage`` gathers its padded rows with
torch's OpenMP threads. This module copies every range of every column in one parallel loop (a numba
``prange`` on numba's OpenMP layer, whose workers keep spinning between calls, so a sample every few
hundred microseconds does not pay a thread wake-up each time; a sleeping pool cost ~85 us per wake-up on
the 2-vCPU VMs this was measured on, more than the copy saves).

The numpy path (one ``np.concatenate`` per field) is used instead when numba is not installed, when numba
ended up on its ``workqueue`` layer (sleeping workers), in a forked child of the process that started the
threads (GNU OpenMP is not fork-safe), and when ``RBPIPE_PARALLEL_GATHER=0``. Both paths return the same
bytes (``tests/storage/test_gather.py``).
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

import numpy as np

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
    if _state["pid"] == os.getpid():
        return _state["kernels"] if _env_enabled() else None
    with _lock:
        if _state["pid"] is None:
            kernels = None
            try:
                import numba

                from rbpipe.storage import _kernels as kernels
                one = np.zeros((1, 2), np.int64)
                kernels.gather_arrays(one, CHUNK_BYTES)  # compile, or load the on-disk cache
                kernels.whole_group_positions(one[0], one[0], one[0])
                if numba.threading_layer() == "workqueue":
                    kernels = None
                _state["numba"] = numba
            except ImportError:
                pass
            _state["kernels"] = kernels
        else:  # a forked child: the parent's OpenMP threads do not exist here
            _state["kernels"] = None
        _state["pid"] = os.getpid()
    return _kernels()


def parallel_available() -> bool:
    """True when whole groups are copied on several threads in this process (see the module doc)."""
    return _kernels() is not None


def whole_groups(rows: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray | None:
    """Positions of the groups (``starts``/``stops`` of live groups) that ``rows`` lists whole and in row
    order, or None when ``rows`` is anything else or the parallel path is off."""
    kernels = _kernels()
    if kernels is None or not rows.size:
        return None
    found = kernels.whole_group_positions(rows, starts, stops)
    return found if found.size else None


def _ranges(columns: Sequence, table: dict) -> np.ndarray | None:
    """Addresses then byte counts of every array of one decoded block, in column order (a ragged column
    gives its flat values, then its shapes); None when one of them is not contiguous."""
    arrays = []
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
    numba = _state["numba"]
    want = max(1, min(_torch_threads(), numba.config.NUMBA_NUM_THREADS, MAX_THREADS))
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)
    buf, starts, sizes = kernels.gather_arrays(np.stack(plans), CHUNK_BYTES)
    views = iter([buf[s:s + n] for s, n in zip(starts.tolist(), sizes.tolist())])
    out: dict = {}
    for c in columns:
        if c.ragged:
            values, shapes = next(views).view(c.np_dtype), next(views).view(np.int64).reshape(rows, c.ndim)
            out[c.key] = [(values, shapes)]
        else:
            out[c.key] = next(views).view(c.np_dtype).reshape(rows, *c.shape, *((2,) if c.complex else ()))
    return out


def _torch_threads() -> int:
    import torch
    return torch.get_num_threads()
