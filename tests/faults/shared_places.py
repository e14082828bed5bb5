"""What a run could leave in places shared with every other process of the machine (/dev/shm, /tmp), told apart
from what other people's runs on the same machine hold right now: a test compares it before and after its run."""

from __future__ import annotations

import os
from pathlib import Path

from rbpipe.procs import SOCKET_DIR_PREFIX


def leftovers() -> set[str]:
    """What a process of ours could leave in shared places that nobody holds any more: files in /dev/shm that no
    live process maps (a named semaphore, a weights file) and rbpipe socket directories in /tmp whose owner lock
    is free. Other people's runs on this machine hold theirs, so they never count."""
    import fcntl

    shm = {f"/dev/shm/{f}" for f in os.listdir("/dev/shm") if f.startswith(("rbpipe", "sem.mp"))}
    if shm:
        shm -= mapped()
    socks = set()
    for name in os.listdir("/tmp"):
        if name.startswith(SOCKET_DIR_PREFIX):
            try:
                fd = os.open(f"/tmp/{name}/.owner", os.O_RDWR)
            except OSError:  # removed meanwhile, or being created
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                socks.add(f"/tmp/{name}")
            except BlockingIOError:
                pass
            finally:
                os.close(fd)
    return shm | socks


def mapped() -> set[str]:
    """Paths in /dev/shm mapped by some live process."""
    found = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
            found.update(line.split(None, 5)[5].removesuffix(" (deleted)") for line in maps.splitlines()
                         if "/dev/shm/" in line and len(line.split(None, 5)) == 6)
    return found
