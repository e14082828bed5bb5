"""Staging area: where a trajectory's payload waits on disk until its group is complete.

The payload is written once, by the process that produced it; only its handle (a path relative to the
staging directory) crosses the manager. Files are written completely before the handle is registered, so a
writer killed while staging leaves at most an unregistered file (never a registered, half-written one).

Each process stages into its own subdirectory (``<pid>-<rand>/<n>.td``): creating, renaming and unlinking
entries of one directory from several processes serialise on that directory's lock. Creating a file costs
~70 us on ext4 (inode allocation), so a deleted payload file is renamed to ``.free-...`` in its *owner's*
subdirectory (whoever deletes it: the process completing a group deletes the members of every writer), and
``put`` rewrites one of those and renames it to the new handle. A process also keeps the payloads it staged
last in memory (``Staging.RECENT``) so completing a group does not read its own members back.

Who owns a subdirectory is told by a lock, never by its PID (the ``<pid>`` in its name is informative only:
a process in another PID namespace, container or host may carry any number there): its owner creates the lock
file ``.<pid>-<rand>.owner`` beside it (before the subdirectory itself) and holds an ``fcntl.flock``
``LOCK_EX`` on it for as long as it lives; the kernel drops the lock when the process dies, however it dies.
A sweep treats a subdirectory as gone only when it can take that lock without waiting (and lets go right
after): it then unlinks the ``.free-*`` files (pending payloads stay for a resumed run) and, once nothing else
is left, the subdirectory and its lock file. A subdirectory without a lock file (written by an older rbpipe)
falls back to the liveness of the PID in its name.

Staged files are data, never code: the payload format below is read by plain slicing (no pickle: a file planted
in the staging directory can at worst be refused as torn), directories are ``0700`` and files ``0600``, and a
handle is only ever accepted in the exact form ``<pid>-<8 hex>/<n>.td`` (no ``..``, no absolute path).

Payload format (version 1), little-endian::

    b"RBPS" | version: u8 = 1 (or 2, below) | layout length: u32 | dim count: u32 | layout: UTF-8 JSON
            | dims: int64 x dim count | leaf bytes, back to back

    layout = {"batch_ndim": int, "leaves": [[[key part, ...], dtype name (torch, e.g. "float32"), ndim], ...]}
    dims   = the batch size, then each leaf's shape (version 2: its per-step dims), in layout order

Each leaf is a tensor's raw bytes in C order (native little-endian), ``prod(shape) * itemsize`` of them. The
layout (keys, dtypes, ranks) is the same for every trajectory of a run, so both sides cache it: only the dims
vary.

Version 2 (written only when a trajectory has a leaf of another kind; version 1 is read as before) lets a leaf
entry carry a fourth element, its kind, for trajectories with batch size ``[T]``:

- ``[key, dtype, ndim, "ragged"]``: one tensor per step whose shapes differ between steps (torchrl's
  lazy-stacked LLM steps, e.g. per-token rewards). Its dims are the ``T`` step shapes (``T * ndim`` integers);
  its bytes are the steps' raw bytes back to back.
- ``[key, "str", 1, "str"]``: one Python ``str`` per step (``NonTensorData``/``NonTensorStack``: a prompt
  ``"query"``, text). Its dims are the ``T`` byte lengths; its bytes are the steps' UTF-8 encodings back to back.

Any other non-tensor leaf is refused (:class:`~rbpipe.errors.BadTrajectoryError`): nothing is ever pickled.
A version 2 payload reads back as a ``LazyStackedTensorDict`` of ``T`` steps (strings as ``NonTensorData``);
its leaves whose steps all have one shape are written as version 1 leaves (no kind). A group that cannot be written
is moved whole to ``quarantine/<claim id>/`` (its payloads and a ``reason.json``), out of the handle namespace,
for a person to inspect.
"""

from __future__ import annotations

import atexit
import fcntl
import itertools
import json
import math
import os
import re
import shutil
import stat
import struct
import uuid
from pathlib import Path

import torch
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    TensorDict,
    TensorDictBase,
    lazy_stack,
)
from tensordict.utils import is_non_tensor

from rbpipe.errors import BadTrajectoryError, RbpipeError
from rbpipe.grouping.registry import decode_tensor
from rbpipe.system.procs import shared_memory_dir


class StagingError(RbpipeError):
    """A staged trajectory payload cannot be written or read back."""


#: dtypes numpy cannot hold: their bytes are taken through a uint8 view
_VIEW_ONLY = frozenset({torch.bfloat16, torch.complex32} | {getattr(torch, n) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64")
    if hasattr(torch, n)})


MAGIC, VERSION = b"RBPS", 1
_PREFIX = struct.Struct("<4sBII")
#: the dtypes a payload may name (a header is data: never ``getattr`` an arbitrary name)
_DTYPES = {str(dt)[6:]: dt for dt in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128,
    *[getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                   "uint16", "uint32", "uint64") if hasattr(torch, n)])}
_ITEMSIZE = {name: dt.itemsize for name, dt in _DTYPES.items()}
_HEADER_MAX = 1 << 24


def _raw(t: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    if t.requires_grad or t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().cpu().contiguous()
    try:
        raw = None if t.dtype in _VIEW_ONLY else t.numpy().tobytes()
    except (TypeError, RuntimeError):  # e.g. a conjugate or negative view
        raw = None
    if raw is None:
        t = t.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return t, raw


_LAYOUTS: dict = {}  # (batch ndim, ((key, dtype name, ndim), ...)) -> layout JSON bytes, on the writing side
_PARSED: dict = {}  # layout JSON bytes -> checked ((key, dtype name, itemsize, ndim), ...), on the reading side
_CACHE_MAX = 256


def _layout_bytes(signature: tuple) -> bytes:
    text = _LAYOUTS.get(signature)
    if text is None:
        batch_ndim, leaves = signature
        text = json.dumps({"batch_ndim": batch_ndim, "leaves": [
            [[k] if isinstance(k, str) else list(k), *rest] for k, *rest in leaves]}).encode()
        if len(_LAYOUTS) < _CACHE_MAX:
            _LAYOUTS[signature] = text
    return text


def encode_td(td: TensorDictBase) -> bytes:
    """TensorDict -> payload bytes (format in the module docstring): raw tensor buffers, no serializer."""
    leaves = _tensor_leaves(td)
    if leaves is None:  # non-tensor leaves, or steps of different shapes: version 2
        return _encode_steps(td)
    signature, dims, chunks = [], list(td.batch_size), []
    for key, value in leaves:
        t, raw = _raw(value)
        signature.append((key, str(t.dtype)[6:], t.ndim))
        dims.extend(t.shape)
        chunks.append(raw)
    layout = _layout_bytes((td.batch_dims, tuple(signature)))
    return b"".join([_PREFIX.pack(MAGIC, VERSION, len(layout), len(dims)), layout,
                     struct.pack(f"<{len(dims)}q", *dims), *chunks])


def _tensor_leaves(td: TensorDictBase) -> list | None:
    """``(key, tensor)`` of every leaf of a TensorDict of tensors only (the common case), else None."""
    out: list = []
    return out if _walk(td, (), out) else None


def _walk(td, prefix: tuple, out: list) -> bool:
    if type(td) is not TensorDict:
        return False
    for k, v in td._tensordict.items():
        kind = type(v)
        if kind is torch.Tensor or (kind is not TensorDict and isinstance(v, torch.Tensor)):
            out.append((prefix + (k,) if prefix else k, v))
        elif kind is not TensorDict or not _walk(v, prefix + (k,), out):
            return False
    return True


def _row_leaves(td: TensorDictBase, prefix: tuple, out: dict) -> None:
    """Leaves of one step: tensors, ``str`` (from ``NonTensorData``), anything else as it is (refused later)."""
    for k, v in td.items():
        key = prefix + (k,)
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif is_non_tensor(v):
            out[key] = v.data if isinstance(v, NonTensorData) else v.tolist()
        elif isinstance(v, TensorDictBase):
            _row_leaves(v, key, out)
        else:
            out[key] = v


def _steps(td: TensorDictBase) -> list[dict]:
    if td.batch_dims != 1:
        raise BadTrajectoryError(f"a trajectory with non-tensor leaves or steps of different shapes must have "
                                 f"batch_size [T], got {tuple(td.batch_size)}")
    rows = td.tensordicts if isinstance(td, LazyStackedTensorDict) and td.stack_dim == 0 else td.unbind(0)
    steps = []
    for row in rows:
        leaves: dict = {}
        _row_leaves(row, (), leaves)
        steps.append(leaves)
    if any(s.keys() != steps[0].keys() for s in steps):
        diff = sorted(".".join(k) for k in set().union(*steps) - set(steps[0]).intersection(*steps))
        raise BadTrajectoryError(f"the steps of a trajectory carry different keys ({', '.join(diff)}): every "
                                 "step must have the same leaves")
    return steps


def _encode_steps(td: TensorDictBase) -> bytes:
    """Version 2: per key, a dense leaf (equal shapes), a ragged one (one shape per step) or one str a step."""
    steps = _steps(td)
    signature, dims, chunks = [], list(td.batch_size), []
    for key in steps[0]:
        values = [s[key] for s in steps]
        name = key[0] if len(key) == 1 else key
        if all(isinstance(v, str) for v in values):
            data = [v.encode() for v in values]
            signature.append((name, "str", 1, "str"))
            dims.extend(len(b) for b in data)
            chunks.extend(data)
        elif all(isinstance(v, torch.Tensor) and not v.is_nested for v in values):
            _tensor_steps(name, values, signature, dims, chunks)
        else:
            bad = next(v for v in values if not isinstance(v, (str, torch.Tensor)) or isinstance(v, torch.Tensor)
                       and v.is_nested)
            raise BadTrajectoryError(
                f"leaf {'.'.join(key)!r} holds {type(bad).__name__}: a staged trajectory may hold tensors and str "
                "only (rbpipe never pickles data); convert it to a tensor or a str, or remove it")
    layout = _layout_bytes((td.batch_dims, tuple(signature)))
    return b"".join([_PREFIX.pack(MAGIC, 2, len(layout), len(dims)), layout,
                     struct.pack(f"<{len(dims)}q", *dims), *chunks])


def _tensor_steps(name, values: list, signature: list, dims: list, chunks: list) -> None:
    dtypes, ndims = {v.dtype for v in values}, {v.ndim for v in values}
    if len(dtypes) > 1 or len(ndims) > 1:
        raise BadTrajectoryError(f"leaf {name!r} changes dtype or number of dimensions between steps "
                                 f"({sorted(map(str, dtypes))}, ndim {sorted(ndims)}): only its sizes may vary")
    if len({v.shape for v in values}) == 1:  # same shape every step: one dense leaf, as version 1
        t, raw = _raw(torch.stack(values))
        signature.append((name, str(t.dtype)[6:], t.ndim))
        dims.extend(t.shape)
        chunks.append(raw)
        return
    signature.append((name, str(values[0].dtype)[6:], values[0].ndim, "ragged"))
    for v in values:
        t, raw = _raw(v)
        dims.extend(t.shape)
        chunks.append(raw)


def _torn(why: str) -> StagingError:
    return StagingError(f"not a staged payload ({why}): torn by a kill mid-write, or not written by rbpipe")


def _parse_layout(text: bytes) -> tuple[int, tuple]:
    """Check a layout (only JSON lists, strings and integers: checked here, never evaluated)."""
    cached = _PARSED.get(text)
    if cached is not None:
        return cached
    try:
        layout = json.loads(text)
        batch_ndim, entries = layout["batch_ndim"], layout["leaves"]
        leaves = []
        for parts, dtype, ndim, *kind in entries:
            if not (type(parts) is list and parts and {type(p) for p in parts} == {str}):
                raise TypeError("a key is a list of strings")
            if type(ndim) is not int or not 0 <= ndim <= 64:
                raise TypeError("bad rank")
            kind = kind[0] if kind else None
            if kind not in (None, "ragged", "str") or (kind == "str") != (dtype == "str") or (
                    kind is not None and batch_ndim != 1) or (kind == "str" and ndim != 1):
                raise TypeError(f"bad leaf kind {kind!r}")
            itemsize = 1 if kind == "str" else _ITEMSIZE[dtype]
            leaves.append((parts[0] if len(parts) == 1 else tuple(parts), dtype, itemsize, ndim, kind))
        if type(batch_ndim) is not int or not 0 <= batch_ndim <= 64:
            raise TypeError("bad batch rank")
    except (ValueError, KeyError, TypeError) as err:
        raise _torn(f"bad layout: {err}") from err
    parsed = (batch_ndim, tuple(leaves))
    if len(_PARSED) < _CACHE_MAX:
        _PARSED[text] = parsed
    return parsed


#: the dtype ``decode_leaves`` gives a leaf of one ``str`` per step; a ragged leaf's is ``(RAGGED, dtype name)``
STR, RAGGED = "str", "ragged"


#: dtypes of decoded leaves that are one tensor (version 1's only kind): ``dtype in PLAIN``
PLAIN = frozenset(_ITEMSIZE)


def is_plain(dtype) -> bool:
    """Whether a decoded leaf (its ``dtype``) is one tensor (version 1's only kind)."""
    return dtype in PLAIN


def decode_leaves(data: bytes) -> tuple[tuple, list[tuple]]:
    """bytes -> ``(batch_size, [(key, dtype, shape, raw bytes), ...])``; refuses anything malformed. A ragged
    leaf has dtype ``(RAGGED, name)`` and one shape per step; a str leaf dtype ``STR`` and one byte length per
    step."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise _torn("too short")
    magic, version, size, ndims = _PREFIX.unpack_from(view)
    at = _PREFIX.size + size
    end_dims = at + 8 * ndims
    if magic != MAGIC or version not in (1, 2) or size > _HEADER_MAX or end_dims > len(view):
        raise _torn("bad prefix")
    batch_ndim, layout = _parse_layout(bytes(view[_PREFIX.size:at]))
    dims = struct.unpack_from(f"<{ndims}q", view, at)
    steps = dims[0] if batch_ndim == 1 and dims else 0
    if batch_ndim + sum(nd if kind is None else steps * nd for _, _, _, nd, kind in layout) != ndims or (
            dims and min(dims) < 0) or (version == 1 and any(leaf[4] for leaf in layout)):
        raise _torn("dims do not match the layout")
    at, i = end_dims, batch_ndim
    leaves = []
    for key, dtype, itemsize, ndim, kind in layout:
        if kind is None:
            shape = dims[i:i + ndim]
            i += ndim
            count = math.prod(shape)
        else:
            flat = dims[i:i + steps * ndim]
            i += steps * ndim
            shape = flat if kind == STR else tuple(flat[j:j + ndim] for j in range(0, len(flat), ndim))
            count = sum(flat) if kind == STR else sum(math.prod(s) for s in shape)
            dtype = STR if kind == STR else (RAGGED, dtype)
        end = at + count * itemsize
        if end > len(view):
            raise _torn("missing bytes")
        leaves.append((key, dtype, shape, view[at:end]))
        at = end
    if at != len(view):
        raise _torn("trailing bytes")
    return dims[:batch_ndim], leaves


def td_from_leaves(batch_size: tuple, leaves: list[tuple]) -> TensorDictBase:
    """Inverse of :func:`encode_td` once decoded by :func:`decode_leaves` (version 2 leaves: a lazy stack of
    steps, as torchrl's LLM layout)."""
    if not all(is_plain(dtype) for _, dtype, _, _ in leaves):
        return _steps_from_leaves(batch_size[0], leaves)
    td = TensorDict(batch_size=batch_size)
    for key, dtype, shape, raw in leaves:
        td.set(key, decode_tensor(raw, dtype, shape))
    return td


def _steps_from_leaves(steps: int, leaves: list[tuple]) -> TensorDictBase:
    rows = [TensorDict() for _ in range(steps)]
    for key, dtype, shape, raw in leaves:
        if dtype == STR:
            text, at = bytes(raw), 0
            for row, n in zip(rows, shape, strict=True):
                row.set_non_tensor(key, text[at:at + n].decode())
                at += n
        elif is_plain(dtype):
            for row, t in zip(rows, decode_tensor(raw, dtype, shape).unbind(0), strict=True):
                row.set(key, t)
        else:
            flat = decode_tensor(raw, dtype[1], (len(raw) // _ITEMSIZE[dtype[1]],))
            for row, t, s in zip(rows, flat.split([math.prod(s) for s in shape]), shape, strict=True):
                row.set(key, t.reshape(s))
    return lazy_stack(rows, 0)


def decode_td(data: bytes) -> TensorDict:
    return td_from_leaves(*decode_leaves(data))


def temporary_staging_parent() -> str:
    """Where a temporary staging directory goes: shared memory when there is one, else the temp dir."""
    import tempfile

    return shared_memory_dir() or tempfile.gettempdir()


#: staging subdirectories this process created (``path -> pid``), and the staging roots it used: released at
#: exit even when the ``Staging`` object is gone by then
_OWN_DIRS: dict[str, int] = {}
#: the lock files this process holds for its subdirectories (``subdirectory path -> fd``)
_LOCKS: dict[str, int] = {}
_ROOTS: set[str] = set()
#: temporary staging directories this process made: removed when it exits (``path -> creator pid``)
_TEMPORARY: dict[str, int] = {}


def _release_all() -> None:
    """At exit: unlink released files (this process's and those of processes that are gone), and remove the
    temporary staging directories this process made."""
    pid = os.getpid()
    for path, owner in list(_OWN_DIRS.items()):
        if owner == pid:
            _release_own(path)
    for root in list(_ROOTS):
        try:
            _sweep(root)
        except OSError:  # the directory is gone already
            pass
    for path, creator in list(_TEMPORARY.items()):
        if creator == pid:
            shutil.rmtree(path, ignore_errors=True)
            _TEMPORARY.pop(path, None)


def remove_at_exit(path, remove: bool = True) -> None:
    """Remove the temporary staging directory ``path`` when this process exits (``remove=False``: forget it)."""
    if remove:
        _TEMPORARY[str(path)] = os.getpid()
    else:
        _TEMPORARY.pop(str(path), None)


def _register_exit_hooks() -> None:
    """``atexit`` does not run in ``multiprocessing``/``multiprocess`` children (they leave by ``os._exit``):
    their own exit finalizers do."""
    import multiprocessing.util as std_util

    import multiprocess.util as mp_util

    for util in (std_util, mp_util):
        util.Finalize(None, _release_all, exitpriority=5)


atexit.register(_release_all)
_register_exit_hooks()
def _forget_locks() -> None:
    """In a forked child: close its copies of the parent's lock files (the lock is held as long as any copy
    is open: a child that outlives its parent must not keep the parent's subdirectories looking alive)."""
    for fd in _LOCKS.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCKS.clear()


os.register_at_fork(after_in_child=_forget_locks)
os.register_at_fork(after_in_child=_register_exit_hooks)  # a forked child's copies are ignored (other pid)


def _after_multiprocess_fork(_) -> None:
    _register_exit_hooks()  # multiprocess clears its finalizers in the children it forks, after the hook above


def _register_after_multiprocess_fork() -> None:
    import multiprocess.util as mp_util

    mp_util.register_after_fork(_after_multiprocess_fork, _after_multiprocess_fork)


_register_after_multiprocess_fork()

#: the only handle form accepted from anywhere: ``<pid>-<8 hex>/<n>.td``
HANDLE = re.compile(r"[0-9]+-[0-9a-f]{8}/[0-9]+\.td")
_OWNER_DIR = re.compile(r"[0-9]+-[0-9a-f]{8}")
QUARANTINE = "quarantine"


def _private_dir(path: Path) -> None:
    """Create ``path`` (0700), or tighten it to 0700 when it exists and belongs to this user."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class Staging:
    """Directory of staged trajectories named by handle; safe for many processes (one file per trajectory)."""

    SUFFIX = ".td"
    #: Prefix of released payload files kept for reuse (``.free-PID-...``): not payloads, never read.
    FREE = ".free-"
    POOL = 256
    #: Puts that found no released file of their own before the subdirectory is scanned for files that
    #: other processes released into it.
    RESCAN_EVERY = 16
    #: Payloads this process staged last, kept in memory so completing a group need not read them back.
    RECENT = 256
    RECENT_MAX_BYTES = 32 << 20  # payloads over RECENT_MAX_BYTES / RECENT are not kept

    def __init__(self, path) -> None:
        self.path = Path(path).resolve()
        try:
            _private_dir(self.path)
        except OSError as err:
            raise StagingError(f"cannot create the staging directory {self.path}: {err}. Pass a writable "
                               "staging_dir (e.g. STORE/staging)") from err
        self._dir = str(self.path)
        self._pid: int | None = None
        self._prefix: str | None = None
        self._counter = itertools.count()
        self._free: list[str] = []
        self._free_ids = itertools.count()
        self._recent: dict[str, bytes] = {}
        _ROOTS.add(self._dir)

    def __getstate__(self) -> dict:
        return {"path": str(self.path)}

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, state["path"])

    def _own(self) -> str:
        """This process's subdirectory name (a forked child gets its own, and not the parent's free files)."""
        pid = os.getpid()
        if self._pid != pid or self._prefix is None:  # (the two are set together)
            try:
                prefix = _new_owned_dir(self._dir, pid)
            except OSError as err:
                raise StagingError(f"cannot create a staging subdirectory in {self.path}: {err}. Free disk "
                                   "space or check permissions") from err
            self._pid, self._prefix, self._free, self._misses = pid, prefix, [], 0
            _OWN_DIRS[os.path.join(self._dir, prefix)] = pid
        return self._prefix

    def _new_handle(self) -> str:
        return f"{self._own()}/{next(self._counter)}{self.SUFFIX}"

    def _take_free(self) -> str | None:
        """A released payload file of this process's subdirectory to rewrite, or None."""
        try:
            return self._free.pop()  # list.pop is atomic: threads never get the same file
        except IndexError:
            pass
        self._misses += 1
        if self._misses < self.RESCAN_EVERY:
            return None
        self._misses = 0  # files other processes released into our subdirectory since we last looked
        own = os.path.join(self._dir, self._own())  # (put set it: the same prefix)
        with os.scandir(own) as it:
            self._free.extend(e.path for e in it if e.name.startswith(self.FREE))
        return self._free.pop() if self._free else None

    def put(self, td: TensorDictBase | bytes) -> str:
        """Stage ``td`` (or its :func:`encode_td` bytes); returns its handle."""
        handle = self._new_handle()
        data = td if isinstance(td, bytes) else encode_td(td)
        target = os.path.join(self._dir, handle)
        try:
            while True:  # reuse a released file: no inode allocation
                free = self._take_free()
                if free is None:
                    break
                try:
                    fd = os.open(free, os.O_WRONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    _write_all(fd, data)
                    os.ftruncate(fd, len(data))
                except OSError:
                    os.unlink(free)  # e.g. a full disk: do not leave the half-rewritten file behind
                    raise
                finally:
                    os.close(fd)
                os.rename(free, target)  # atomic: the handle's file is complete from its first instant
                break
            if free is None:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    _write_all(fd, data)
                finally:
                    os.close(fd)
        except OSError as err:
            raise StagingError(f"cannot stage a trajectory in {self.path}: {err}. Free disk space or check "
                               "permissions") from err
        if len(data) <= self.RECENT_MAX_BYTES // self.RECENT:
            recent = self._recent
            recent[handle] = data
            if len(recent) > self.RECENT:
                try:
                    del recent[next(iter(recent))]
                except (KeyError, RuntimeError, StopIteration):  # another thread trimmed it meanwhile
                    pass
        return handle

    def load(self, handle: str) -> TensorDictBase:
        return decode_td(self.read(handle))

    def _path(self, handle) -> str:
        """The file of ``handle``; anything but the exact handle form (``..``, an absolute path, another
        directory) is refused: handles come from the manager, and must not reach outside this directory."""
        if not (isinstance(handle, str) and HANDLE.fullmatch(handle)):
            raise StagingError(f"refusing staged-payload handle {handle!r}: handles have the form "
                               "'<pid>-<8 hex>/<n>.td' inside the staging directory")
        return os.path.join(self._dir, handle)

    def read(self, handle: str) -> bytes:
        """The staged bytes of ``handle`` (from memory when this process staged it recently)."""
        path = self._path(handle)
        data = self._recent.pop(handle, None)
        if data is not None:
            return data
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as err:
            raise StagingError(f"staged trajectory {handle} is missing from {self.path}: the staging directory "
                               "was cleaned while its group was still pending") from err
        try:
            size = os.fstat(fd).st_size
            data = os.read(fd, size)
            if len(data) == size:
                return data
            chunks = [data]
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def delete(self, handles) -> None:
        """Remove staged payloads. Each file is renamed to ``.free-...`` in its owner's subdirectory for the
        owner's ``put`` to reuse (never read); beyond ``POOL`` of this process's own, files are unlinked."""
        handles = list(handles)
        paths = [self._path(h) for h in handles]  # every handle checked before any file is touched
        prefix = self._own()
        recent = self._recent
        for handle, path in zip(handles, paths, strict=True):
            recent.pop(handle, None)
            owner = os.path.dirname(handle)
            try:
                if owner == prefix and len(self._free) >= self.POOL or not owner:
                    os.unlink(path)
                    continue
                free = os.path.join(self._dir, owner, f"{self.FREE}{prefix}-{next(self._free_ids)}")
                os.rename(path, free)
                if owner == prefix:
                    self._free.append(free)
            except FileNotFoundError:
                pass

    def release(self) -> None:
        """Unlink the released files of this process's subdirectory (and the subdirectory once it is empty),
        and those that were renamed into the subdirectories of processes that are gone (at exit; a killed
        process leaves its own to the next :meth:`sweep`)."""
        self._free = []
        if self._pid == os.getpid() and self._prefix is not None \
                and _release_own(os.path.join(self._dir, self._prefix)):
            self._pid = None  # its subdirectory is gone: a later put makes a new one
        try:
            self.sweep()
        except OSError:  # the directory is gone already
            pass

    def sweep(self) -> int:
        """Unlink released files in the subdirectories of processes that are gone; returns how many."""
        return _sweep(self._dir)

    def handles(self) -> list[str]:
        """Every staged payload's handle (``<process dir>/<n>.td``)."""
        found = (p.relative_to(self.path).as_posix() for p in self.path.glob(f"*/*{self.SUFFIX}"))
        return sorted(h for h in found if HANDLE.fullmatch(h))

    def quarantine(self, claim_id: str, handles: list[str], record: dict) -> Path:
        """Move a group that cannot be written out of the handle namespace (a resume does not queue it again),
        with ``reason.json``, into ``quarantine/<claim id>/``; returns that directory."""
        if not re.fullmatch(r"[0-9a-f]{32}", str(claim_id)):
            raise StagingError(f"refusing claim id {claim_id!r}")
        paths = [self._path(h) for h in handles]
        target = self.path / QUARANTINE / claim_id
        _private_dir(target)
        for i, (handle, path) in enumerate(zip(handles, paths, strict=True)):
            self._recent.pop(handle, None)
            try:
                os.rename(path, target / f"{i}{self.SUFFIX}")
            except FileNotFoundError:  # deleted already (e.g. by a writer that died after its commit)
                pass
        fd = os.open(target / "reason.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, default=repr)
        return target


OWNER_SUFFIX = ".owner"
_OWNER_FILE = re.compile(r"\.([0-9]+-[0-9a-f]{8})\.owner")
_NO_LOCK_FILE = -1


def _lock_path(directory: str) -> str:
    """The lock file of staging subdirectory ``directory`` (beside it: ``.<name>.owner``)."""
    head, name = os.path.split(directory)
    return os.path.join(head, f".{name}{OWNER_SUFFIX}")


def _new_owned_dir(root: str, pid: int) -> str:
    """Create a subdirectory of ``root`` whose lock this process holds; returns its name. The lock file comes
    first, so a subdirectory never exists unlocked while its owner lives."""
    for _ in range(16):
        prefix = f"{pid}-{uuid.uuid4().hex[:8]}"
        lock = os.path.join(root, f".{prefix}{OWNER_SUFFIX}")
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fresh = os.fstat(fd).st_nlink > 0  # not unlinked by a sweep between its creation and the lock
        except BlockingIOError:  # a sweep took it in that instant: try another name
            fresh = False
        except BaseException:
            os.close(fd)
            raise
        if not fresh:
            os.close(fd)
            continue
        try:
            os.mkdir(os.path.join(root, prefix), 0o700)
        except BaseException:
            os.close(fd)
            _unlink(lock)
            raise
        _LOCKS[os.path.join(root, prefix)] = fd
        return prefix
    raise OSError(f"could not create an owned staging subdirectory in {root}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _try_lock(path: str) -> int | None:
    """An fd holding ``path``'s lock when nobody else holds it (its owner is gone), None while its owner lives
    (or another sweep is at it), ``_NO_LOCK_FILE`` when there is no lock file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return _NO_LOCK_FILE
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_nlink > 0:
            return fd
    except BlockingIOError:
        pass
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)  # held by its owner, or unlinked by another sweep
    return None


def _release_own(path: str) -> bool:
    """This process lets go of its subdirectory ``path``: its released files are unlinked, and the
    subdirectory with its lock file once nothing else is left. True when the subdirectory is gone."""
    _remove_free_files(path)
    if os.path.isdir(path):
        return False
    _unlink(_lock_path(path))
    fd = _LOCKS.pop(path, None)
    _OWN_DIRS.pop(path, None)
    if fd is not None:
        os.close(fd)
    return True


def _sweep(root: str) -> int:
    """Unlink released files in ``root``'s subdirectories whose owners are gone (their lock is free), and
    those subdirectories once nothing else is left in them; returns how many files."""
    from rbpipe.system.procs import pid_alive

    n = 0
    with os.scandir(root) as it:
        entries = list(it)
    dirs = {e.name for e in entries if _OWNER_DIR.fullmatch(e.name) and e.is_dir(follow_symlinks=False)}
    for name in sorted(dirs):
        path = os.path.join(root, name)
        if path in _LOCKS:  # this process's own
            continue
        lock = _lock_path(path)
        fd = _try_lock(lock)
        if fd is None:  # its owner lives, whatever its PID says here
            continue
        if fd == _NO_LOCK_FILE:  # made by an rbpipe without lock files: its PID is all there is
            if not pid_alive(int(name.split("-", 1)[0])):
                n += _remove_free_files(path)
            continue
        try:
            n += _remove_free_files(path)
            if not os.path.isdir(path):
                _unlink(lock)
        finally:
            os.close(fd)
    for entry in entries:  # lock files left without their subdirectory (a sweep or an owner cut short)
        match = _OWNER_FILE.fullmatch(entry.name)
        if match is None or match.group(1) in dirs:
            continue
        fd = _try_lock(entry.path)
        if fd is None or fd == _NO_LOCK_FILE:
            continue
        try:
            if not os.path.isdir(os.path.join(root, match.group(1))):
                _unlink(entry.path)
        finally:
            os.close(fd)
    return n


def _remove_free_files(directory: str) -> int:
    """Unlink the ``.free-*`` files of a staging subdirectory, then the subdirectory if nothing else is left."""
    n = 0
    try:
        with os.scandir(directory) as it:
            for e in it:
                if e.name.startswith(Staging.FREE):
                    try:
                        os.unlink(e.path)
                        n += 1
                    except FileNotFoundError:
                        pass
        os.rmdir(directory)
    except OSError:  # gone already, or payloads still pending in it
        pass
    return n
