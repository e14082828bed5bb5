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
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import uuid
import weakref
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


def encode_td(td: TensorDictBase) -> bytes:
    """TensorDict -> bytes: raw tensor buffers, no torch serialization (10x cheaper than pickling the td)."""
    leaves = []
    for key, value in td.items(True, True):
        if isinstance(value, torch.Tensor):
            t = value
            if t.requires_grad or t.device.type != "cpu" or not t.is_contiguous():
                t = t.detach().cpu().contiguous()
            try:
                raw = None if t.dtype in _VIEW_ONLY else t.numpy().tobytes()
            except (TypeError, RuntimeError):  # e.g. a conjugate or negative view
                raw = None
            if raw is None:
                t = t.detach().cpu().contiguous()
                raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
            leaves.append((key, str(t.dtype)[6:], tuple(t.shape), raw))
        else:
            leaves.append((key, None, None, value))
    return pickle.dumps((tuple(td.batch_size), leaves), protocol=pickle.HIGHEST_PROTOCOL)


def decode_leaves(data: bytes) -> tuple[tuple, list[tuple]]:
    """bytes -> ``(batch_size, [(key, dtype name | None, shape, raw bytes | non-tensor value), ...])``."""
    return pickle.loads(data)


def td_from_leaves(batch_size: tuple, leaves: list[tuple]) -> TensorDict:
    """Inverse of :func:`encode_td` once decoded by :func:`decode_leaves`."""
    td = TensorDict(batch_size=batch_size)
    for key, dtype, shape, raw in leaves:
        if dtype is None:
            td.set_non_tensor(key, raw)
            continue
        td.set(key, decode_tensor(raw, dtype, shape))
    return td


def decode_td(data: bytes) -> TensorDict:
    return td_from_leaves(*decode_leaves(data))


def temporary_staging_parent() -> str:
    """Where a temporary staging directory goes: shared memory when there is one, else the temp dir."""
    import tempfile

    return shared_memory_dir() or tempfile.gettempdir()


_LIVE: "weakref.WeakSet[Staging]" = weakref.WeakSet()


@atexit.register
def _release_all() -> None:
    for staging in list(_LIVE):
        staging.release()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class Staging:
    """Directory of pickled trajectories named by handle; safe for many processes (one file per trajectory)."""

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
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StagingError(f"cannot create the staging directory {self.path}: {err}. Pass a writable "
                               "staging_dir (e.g. STORE/staging)") from err
        self._dir = str(self.path)
        self._pid = self._prefix = None
        self._counter = itertools.count()
        self._free: list[str] = []
        self._free_ids = itertools.count()
        self._recent: dict[str, bytes] = {}
        _LIVE.add(self)

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
                os.mkdir(os.path.join(self._dir, prefix))
            except OSError as err:
                raise StagingError(f"cannot create a staging subdirectory in {self.path}: {err}. Free disk "
                                   "space or check permissions") from err
            self._pid, self._prefix, self._free, self._misses = pid, prefix, [], 0
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
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
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

    def read(self, handle: str) -> bytes:
        """The staged bytes of ``handle`` (from memory when this process staged it recently)."""
        data = self._recent.pop(handle, None)
        if data is not None:
            return data
        try:
            fd = os.open(os.path.join(self._dir, handle), os.O_RDONLY | os.O_CLOEXEC)
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
        prefix = self._own()
        recent = self._recent
        for handle in handles:
            recent.pop(handle, None)
            path = os.path.join(self._dir, handle)
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
        """Unlink the released files of this process's subdirectory, and the subdirectory once it is empty
        (at exit; a killed process leaves them to :meth:`sweep`)."""
        self._free = []
        if self._pid != os.getpid():
            return
        _remove_free_files(os.path.join(self._dir, self._prefix))

    def sweep(self) -> int:
        """Unlink released files in the subdirectories of processes that are gone; returns how many."""
        from rbpipe.procs import pid_alive

        n = 0
        for entry in os.scandir(self._dir):
            if not entry.is_dir():
                continue
            try:
                pid = int(entry.name.split("-", 1)[0])
            except ValueError:
                continue
            if pid != os.getpid() and not pid_alive(pid):
                n += _remove_free_files(entry.path)
        return n

    def handles(self) -> list[str]:
        """Every staged payload's handle (``<process dir>/<n>.td``)."""
        return sorted(p.relative_to(self.path).as_posix() for p in self.path.glob(f"*/*{self.SUFFIX}"))


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
