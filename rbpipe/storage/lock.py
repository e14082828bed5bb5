"""``StoreLock``: one launcher per store. The lock is an ``flock`` on ``STORE/.lock``, not the pid written in it.

A pid says nothing once its process is gone (another process may get it) and nothing across PID namespaces,
and taking over a "stale" pid-file lock is a race between everyone who found it stale: three processes at
once could end with two holders. An ``flock`` is released by the kernel when its holder exits, however it
exits, so there is no stale lock to take over: whoever gets the ``flock`` holds the store.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from rbpipe.errors import StoreLockedError
from rbpipe.system.owner_lock import still_at, try_flock

LOCK_FILE = ".lock"


class StoreLock:
    """Exclusive writer lock of a store directory (``STORE/.lock``).

    ``acquire()`` opens (or creates) the lock file and takes an exclusive, non-blocking ``flock`` on it, then
    writes this process's pid, host and start time into it for people to read. If another process holds the
    ``flock``, :class:`StoreLockedError` names it (from what it wrote). A holder that dies releases the lock
    with its last descriptor; a lock file left behind is simply locked again. Readers never need it.

    Examples:
        >>> import tempfile
        >>> store = tempfile.mkdtemp()
        >>> with StoreLock(store) as lock:
        ...     lock.held
        True
        >>> import shutil; shutil.rmtree(store)
    """

    def __init__(self, store_path: str | os.PathLike):
        self.path = Path(store_path) / LOCK_FILE
        self.held = False
        self._fd = -1

    def _holder(self, fd: int) -> dict | None:
        """What the holder wrote (None while it is being written, or from an rbpipe that wrote no JSON)."""
        try:
            data = os.pread(fd, 4096, 0)
            holder = json.loads(data) if data else None
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def acquire(self) -> StoreLock:
        if self.held:
            raise StoreLockedError(f"this StoreLock already holds {str(self.path)!r}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(20):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if not try_flock(fd):
                holder = self._holder(fd)
                os.close(fd)
                raise StoreLockedError(self._refusal(holder))
            if not still_at(self.path, fd):  # its holder released it (and removed the file) meanwhile
                os.close(fd)
                continue
            me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            self._fd, self.held = fd, True
            return self
        raise StoreLockedError(f"could not take the writer lock {str(self.path)!r}: it keeps changing hands")

    def _refusal(self, holder: dict | None) -> str:
        store = str(self.path.parent)
        if holder is None:
            return (f"store {store!r} is locked by another process (it is writing its name into "
                    f"{str(self.path)!r} right now); stop it first")
        if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            return f"this process (pid {os.getpid()}) already holds the writer lock of {store!r}"
        return (f"store {store!r} is locked by pid {holder.get('pid')} on host {holder.get('host')!r}; stop that "
                "process first (the lock is released when it exits, killed or not)")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)  # while still locked: see owner_lock.still_at
            os.close(self._fd)
            self._fd, self.held = -1, False

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


#: The name before issue 34 ("writer" also names torchrl's ``Writer``, writer ids and writer leases): kept for code
#: that imports it.
WriterLock = StoreLock
