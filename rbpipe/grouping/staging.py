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

Staged files are data, never code: the payload format below is read by plain slicing (no pickle: a file planted
in the staging directory can at worst be refused as torn), directories are ``0700`` and files ``0600``, and a
handle is only ever accepted in the exact form ``<pid>-<8 hex>/<n>.td`` (no ``..``, no absolute path).

Payload format (version 1), little-endian::

    b"RBPS" | version: u8 = 1 | layout length: u32 | dim count: u32 | layout: UTF-8 JSON
            | dims: int64 x dim count | leaf bytes, back to back

    layout = {"batch_ndim": int, "leaves": [[[key part, ...], dtype name (torch, e.g. "float32"), ndim], ...]}
    dims   = the batch size, then each leaf's shape, in layout order

Each leaf is a tensor's raw bytes in C order (native little-endian), ``prod(shape) * itemsize`` of them. The
layout (keys, dtypes, ranks) is the same for every trajectory of a run, so both sides cache it: only the dims
vary. Only tensor leaves are staged (what ``td.items(True, True)`` lists). A group that cannot be written is moved whole to ``quarantine/<claim id>/``
(its payloads and a ``reason.json``), out of the handle namespace, for a person to inspect.
"""

from __future__ import annotations

import atexit
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
from tensordict import TensorDict, TensorDictBase

from rbpipe.errors import RbpipeError
from rbpipe.grouping.registry import decode_tensor
from rbpipe.procs import shared_memory_dir


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
            [[k] if isinstance(k, str) else list(k), dt, nd] for k, dt, nd in leaves]}).encode()
        if len(_LAYOUTS) < _CACHE_MAX:
            _LAYOUTS[signature] = text
    return text


def encode_td(td: TensorDictBase) -> bytes:
    """TensorDict -> payload bytes (format in the module docstring): raw tensor buffers, no serializer."""
    signature, dims, chunks = [], list(td.batch_size), []
    for key, value in td.items(True, True):
        if not isinstance(value, torch.Tensor):
            continue
        t, raw = _raw(value)
        signature.append((key, str(t.dtype)[6:], t.ndim))
        dims.extend(t.shape)
        chunks.append(raw)
    layout = _layout_bytes((td.batch_dims, tuple(signature)))
    return b"".join([_PREFIX.pack(MAGIC, VERSION, len(layout), len(dims)), layout,
                     struct.pack(f"<{len(dims)}q", *dims), *chunks])


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
        for parts, dtype, ndim in entries:
            if not (type(parts) is list and parts and {type(p) for p in parts} == {str}):
                raise TypeError("a key is a list of strings")
            if type(ndim) is not int or not 0 <= ndim <= 64:
                raise TypeError("bad rank")
            leaves.append((parts[0] if len(parts) == 1 else tuple(parts), dtype, _ITEMSIZE[dtype], ndim))
        if type(batch_ndim) is not int or not 0 <= batch_ndim <= 64:
            raise TypeError("bad batch rank")
    except (ValueError, KeyError, TypeError) as err:
        raise _torn(f"bad layout: {err}") from err
    parsed = (batch_ndim, tuple(leaves))
    if len(_PARSED) < _CACHE_MAX:
        _PARSED[text] = parsed
    return parsed


def decode_leaves(data: bytes) -> tuple[tuple, list[tuple]]:
    """bytes -> ``(batch_size, [(key, dtype name, shape, raw bytes), ...])``; refuses anything malformed."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise _torn("too short")
    magic, version, size, ndims = _PREFIX.unpack_from(view)
    at = _PREFIX.size + size
    end_dims = at + 8 * ndims
    if magic != MAGIC or version != VERSION or size > _HEADER_MAX or end_dims > len(view):
        raise _torn("bad prefix")
    batch_ndim, layout = _parse_layout(bytes(view[_PREFIX.size:at]))
    dims = struct.unpack_from(f"<{ndims}q", view, at)
    if batch_ndim + sum(leaf[3] for leaf in layout) != ndims or (dims and min(dims) < 0):
        raise _torn("dims do not match the layout")
    at, i = end_dims, batch_ndim
    leaves = []
    for key, dtype, itemsize, ndim in layout:
        shape = dims[i:i + ndim]
        i += ndim
        end = at + math.prod(shape) * itemsize
        if end > len(view):
            raise _torn("missing bytes")
        leaves.append((key, dtype, shape, view[at:end]))
        at = end
    if at != len(view):
        raise _torn("trailing bytes")
    return dims[:batch_ndim], leaves


def td_from_leaves(batch_size: tuple, leaves: list[tuple]) -> TensorDict:
    """Inverse of :func:`encode_td` once decoded by :func:`decode_leaves`."""
    td = TensorDict(batch_size=batch_size)
    for key, dtype, shape, raw in leaves:
        td.set(key, decode_tensor(raw, dtype, shape))
    return td


def decode_td(data: bytes) -> TensorDict:
    return td_from_leaves(*decode_leaves(data))


def temporary_staging_parent() -> str:
    """Where a temporary staging directory goes: shared memory when there is one, else the temp dir."""
    import tempfile

    return shared_memory_dir() or tempfile.gettempdir()


#: staging subdirectories this process created (``path -> pid``), and the staging roots it used: released at
#: exit even when the ``Staging`` object is gone by then
_OWN_DIRS: dict[str, int] = {}
_ROOTS: set[str] = set()
#: temporary staging directories this process made: removed when it exits (``path -> creator pid``)
_TEMPORARY: dict[str, int] = {}


def _release_all() -> None:
    """At exit: unlink released files (this process's and those of processes that are gone), and remove the
    temporary staging directories this process made."""
    pid = os.getpid()
    for path, owner in list(_OWN_DIRS.items()):
        if owner == pid:
            _remove_free_files(path)
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
        self._pid = self._prefix = None
        self._counter = itertools.count()
        self._free: list[str] = []
        self._free_ids = itertools.count()
        self._recent: dict[str, bytes] = {}
        _ROOTS.add(self._dir)

    def __getstate__(self) -> dict:
        return {"path": str(self.path)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def _own(self) -> str:
        """This process's subdirectory name (a forked child gets its own, and not the parent's free files)."""
        pid = os.getpid()
        if self._pid != pid:
            prefix = f"{pid}-{uuid.uuid4().hex[:8]}"
            try:
                os.mkdir(os.path.join(self._dir, prefix), 0o700)
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
        own = os.path.join(self._dir, self._prefix)
        with os.scandir(own) as it:
            self._free.extend(e.path for e in it if e.name.startswith(self.FREE))
        return self._free.pop() if self._free else None

    def put(self, td: TensorDictBase) -> str:
        handle = self._new_handle()
        data = encode_td(td)
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
        for handle, path in zip(handles, paths):
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
        if self._pid == os.getpid():
            _remove_free_files(os.path.join(self._dir, self._prefix))
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
        for i, (handle, path) in enumerate(zip(handles, paths)):
            self._recent.pop(handle, None)
            try:
                os.rename(path, target / f"{i}{self.SUFFIX}")
            except FileNotFoundError:  # deleted already (e.g. by a writer that died after its commit)
                pass
        fd = os.open(target / "reason.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, default=repr)
        return target


def _sweep(root: str) -> int:
    """Unlink released files in ``root``'s subdirectories of processes that are gone; returns how many."""
    from rbpipe.procs import pid_alive

    n = 0
    with os.scandir(root) as it:
        entries = [e for e in it if e.is_dir() and _OWNER_DIR.fullmatch(e.name)]
    for entry in entries:
        pid = int(entry.name.split("-", 1)[0])
        if pid != os.getpid() and not pid_alive(pid):
            n += _remove_free_files(entry.path)
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
