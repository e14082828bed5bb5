"""What a run could leave in places shared with every other process of the machine (/dev/shm, /tmp), told apart
from what other people's runs on the same machine create, hold or leave meanwhile (five engineers run the fault
tests here at once: a diff of /dev/shm before and after a run raced with theirs)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from rbpipe.system.procs import SOCKET_DIR_PREFIX


def private_tmpdir() -> Path:
    """A short temporary directory for one run's ``TMPDIR``: its socket directories go there, where no other run
    on this machine creates or sweeps any (every rbpipe start sweeps the shared /tmp). Short: socket paths."""
    return Path(tempfile.mkdtemp(prefix="rbs-", dir="/tmp"))


def leftovers(launcher_pids: list[int], tmpdir: Path) -> set[str]:
    """What runs whose launchers had ``launcher_pids``, run with ``TMPDIR=tmpdir``, left in shared places: their
    weights files in /dev/shm (named by the launcher's pid) and their socket directories. Other people's runs
    on this machine never count. Named semaphores (``sem.mp-*``) carry no owner: a test checks that no process
    of its run maps one (:func:`semaphores_of`)."""
    from rbpipe.service.weights import WEIGHTS_PREFIX

    prefixes = tuple(f"{WEIGHTS_PREFIX}{pid}-" for pid in launcher_pids)
    shm = {f"/dev/shm/{name}" for name in os.listdir("/dev/shm") if name.startswith(prefixes)}
    return shm | {str(p) for p in tmpdir.glob(f"{SOCKET_DIR_PREFIX}*")}


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


def assert_nothing_left(launcher_pids: list[int], tmpdir: Path, timeout: float = 30.0) -> None:
    """Wait (bounded: a process's exit handlers run a moment after its parent saw it end) until the runs left
    nothing behind (:func:`leftovers`)."""
    deadline = time.monotonic() + timeout
    while (left := leftovers(launcher_pids, tmpdir)) and time.monotonic() < deadline:
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
