"""What a run could leave in places shared with every other process of the machine (/dev/shm, /tmp), told apart
from what other people's runs on the same machine hold right now: a test compares it before and after its run."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rbpipe.procs import SOCKET_DIR_PREFIX


def leftovers() -> set[str]:
    """What a run could leave in shared places that nobody holds any more: weights files in /dev/shm whose process
    is gone, and rbpipe socket directories in /tmp whose owner lock is free. Other people's runs on this machine
    hold theirs, so they never count. Named semaphores (``sem.mp-*``) carry no owner: a test checks that no
    process of its run maps one (:func:`semaphores_of`), as other tests on the machine may leave some."""
    import fcntl

    from rbpipe.procs import pid_alive
    from rbpipe.weights import WEIGHTS_PREFIX

    shm = set()
    for name in os.listdir("/dev/shm"):
        pid = name.removeprefix(WEIGHTS_PREFIX).split("-", 1)[0]
        if name.startswith(WEIGHTS_PREFIX) and pid.isdigit() and not pid_alive(int(pid)):
            shm.add(f"/dev/shm/{name}")
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


def semaphores_of(pids: list[int]) -> set[str]:
    """Named semaphores (/dev/shm/sem.*) that processes ``pids`` have open (mapped): those a SIGKILL of the
    whole run would leave behind for good, as the resource trackers that would unlink them die with it."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        found.update(line.split()[-1] for line in maps.splitlines() if "/dev/shm/sem." in line)
    return found


def assert_nothing_left(before: set[str], timeout: float = 30.0) -> None:
    """Wait (bounded) until nothing new is left behind: a killed worker's resource tracker unlinks its
    semaphores once it sees its process gone, a moment later."""
    deadline = time.monotonic() + timeout
    while (left := leftovers() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left behind for {timeout:.0f} s: {sorted(left)}"


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``, from /proc (no psutil)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(entry))
    return found
