"""Staging area: where a trajectory's payload waits on disk until its group is complete.

The payload is written once, by the process that produced it; only its handle (a path relative to the
staging directory) crosses the manager. Files are written completely before the handle is registered, so a
writer killed while staging leaves at most an unregistered file (never a registered, half-written one).

Each process stages into its own subdirectory (``<pid>-<rand>/<n>.td``): creating, renaming and unlinking
entries of one directory from several processes serialise on that directory's lock. Creating a file is
costly on ext4 (inode allocation; figures: docs/DESIGN.md, Figures behind code choices), so a deleted payload file is
renamed to ``.free-...`` in its *owner's* subdirectory (whoever deletes it: the process completing a group deletes the
members of every writer), and ``put`` rewrites one of those and renames it to the new handle. A process also keeps the
payloads it staged last in memory (``Staging.RECENT``) so completing a group does not read its own members back.

Who owns a subdirectory is told by a lock, never by its PID (the ``<pid>`` in its name is informative only:
a process in another PID namespace, container or host may carry any number there): its owner creates the lock
file ``.<pid>-<rand>.owner`` beside it (before the subdirectory itself) and holds an ``fcntl.flock``
``LOCK_EX`` on it for as long as it lives; the kernel drops the lock when the process dies, however it dies.
A sweep treats a subdirectory as gone only when it can take that lock without waiting (and lets go right
after): it then unlinks the ``.free-*`` files (pending payloads stay for a resumed run) and, once nothing else
is left, the subdirectory and its lock file. A subdirectory without a lock file (written by an older rbpipe)
falls back to the liveness of the PID in its name.

Staged files are data, never code: the payload format (:mod:`rbpipe.grouping.codec`) is read by plain slicing (no
pickle: a file planted in the staging directory can at worst be refused as torn), directories are ``0700`` and files
``0600``, and a handle is only ever accepted in the exact form ``<pid>-<8 hex>/<n>.td`` (no ``..``, no absolute
path).

The payload's bytes are :mod:`rbpipe.grouping.codec`'s. A group that cannot be written is moved whole to
``quarantine/<commit id>/`` (its payloads and a ``reason.json``), out of the handle namespace, for a person to
inspect.

Size (over 500 lines): the staging area and its owner locks, which its sweep reads; the payload codec is already
:mod:`rbpipe.grouping.codec`.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import re
import shutil
import stat
import uuid
from pathlib import Path

from tensordict import (
    TensorDictBase,
)

from rbpipe.grouping.codec import (  # noqa: F401 - re-exported: the staging module's names
    PLAIN,
    StagingError,
    decode_leaves,
    decode_td,
    encode_td,
    is_plain,
    td_from_leaves,
)
from rbpipe.system.owner_lock import NO_LOCK_FILE, create_held, take_if_free
from rbpipe.system.procs import shared_memory_dir


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
#: The file beside a quarantined group's payloads: its record (``commit_id``, group, reason, handles, rows, time).
REASON_FILE = "reason.json"


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

    def quarantine(self, commit_id: str, handles: list[str], record: dict) -> Path:
        """Move a group that cannot be written out of the handle namespace (a resume does not queue it again),
        with ``reason.json``, into ``quarantine/<commit id>/``; returns that directory."""
        if not re.fullmatch(r"[0-9a-f]{32}", str(commit_id)):
            raise StagingError(f"refusing commit id {commit_id!r}")
        paths = [self._path(h) for h in handles]
        target = self.path / QUARANTINE / commit_id
        _private_dir(target)
        for i, (handle, path) in enumerate(zip(handles, paths, strict=True)):
            self._recent.pop(handle, None)
            try:
                os.rename(path, target / f"{i}{self.SUFFIX}")
            except FileNotFoundError:  # deleted already (e.g. by a writer that died after its commit)
                pass
        fd = os.open(target / REASON_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, default=repr)
        return target


def read_quarantine_record(directory) -> dict:
    """The record of the group quarantined in ``directory`` (``quarantine/<commit id>/``), from its
    ``reason.json``. Records written before the key was renamed name the id ``claim_id``: it is read as
    ``commit_id``, so a quarantine left by an earlier version reads like a new one."""
    with open(Path(directory) / REASON_FILE, encoding="utf-8") as f:
        record = json.load(f)
    if isinstance(record, dict) and "claim_id" in record and "commit_id" not in record:
        record = {("commit_id" if key == "claim_id" else key): value for key, value in record.items()}
    return record


OWNER_SUFFIX = ".owner"
_OWNER_FILE = re.compile(r"\.([0-9]+-[0-9a-f]{8})\.owner")


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
        fd = create_held(lock)  # None: taken, or swept between its creation and the lock: another name
        if fd is None:
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
        fd = take_if_free(lock)
        if fd is None:  # its owner lives, whatever its PID says here
            continue
        if fd == NO_LOCK_FILE:  # made by an rbpipe without lock files: its PID is all there is
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
        fd = take_if_free(entry.path)
        if fd is None or fd == NO_LOCK_FILE:
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
