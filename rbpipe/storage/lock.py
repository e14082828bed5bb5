"""``WriterLock``: one launcher per store. A lock file naming the holder (pid, host), stale-safe."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from rbpipe.errors import StoreLockedError
from rbpipe.fsutil import atomic_write
from rbpipe.procs import pid_alive

LOCK_FILE = ".lock"


class WriterLock:
    """Exclusive writer lock of a store directory (``STORE/.lock``).

    ``acquire()`` creates the lock file atomically (``fsutil.atomic_write`` without replacing) with this process's
    pid and host. If it exists and its holder is alive, :class:`StoreLockedError` names the holder; if the holder
    is a dead pid on this host, the stale lock is taken over. Readers never need it.
    """

    def __init__(self, store_path: str | os.PathLike):
        self.path = Path(store_path) / LOCK_FILE
        self.held = False

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            return {"pid": -1, "host": "?", "corrupt": True}

    def acquire(self) -> WriterLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        for _ in range(3):
            # written whole under a temporary name, then linked into place: only one contender's link
            # succeeds, and a reader never sees a half-written holder
            if not atomic_write(self.path, json.dumps(me), fsync=False, replace=False):
                holder = self._holder()
                if holder is None:
                    continue
                if holder.get("pid") == os.getpid() and holder.get("host") == me["host"]:
                    raise StoreLockedError(f"this process (pid {os.getpid()}) already holds the writer lock "
                                           f"of {str(self.path.parent)!r}")
                same_host = holder.get("host") == me["host"]
                if holder.get("corrupt") and time.time() - self.path.stat().st_mtime < 5:
                    time.sleep(0.05)  # being written right now
                    continue
                if holder.get("corrupt") or (same_host and not pid_alive(int(holder.get("pid", -1)))):
                    self._take_over(holder)
                    continue
                raise StoreLockedError(
                    f"store {str(self.path.parent)!r} is locked by pid {holder.get('pid')} on host "
                    f"{holder.get('host')!r}; stop that process first, or, if it is gone (another host), "
                    f"delete {str(self.path)!r}")
            self.held = True
            return self
        raise StoreLockedError(f"could not take the writer lock {str(self.path)!r}: it keeps changing hands")

    def _take_over(self, holder: dict) -> None:
        stale = self.path.with_name(f"{LOCK_FILE}.stale.{os.getpid()}")
        try:
            os.rename(self.path, stale)  # only one contender wins the rename
        except FileNotFoundError:
            return
        try:
            moved = json.loads(stale.read_text())
        except ValueError:
            moved = {"corrupt": True}
        if moved.get("pid") != holder.get("pid") and not moved.get("corrupt"):
            try:  # we raced and moved a fresh lock: put it back
                os.link(stale, self.path)
            except FileExistsError:
                pass
        stale.unlink(missing_ok=True)

    def release(self) -> None:
        if self.held:
            holder = self._holder()
            if holder and holder.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
