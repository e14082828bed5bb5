"""The store's writer lock is an ``flock``: a holder in another process is refused by name, a killed holder's
lock is free at once, and three processes taking over a lock file left by a dead process end with exactly one
holder, also when each is held up at the worst moment (forced delays)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import multiprocess
import pytest

from rbpipe.errors import StoreLockedError
from rbpipe.storage import StoreLock


def _contender(store: str, role: str, start, results, done) -> None:
    """Take the lock when ``start`` fires; report ``held``/``refused``; a holder keeps it until ``done``.

    Delays force the interleaving that gave two holders with a pid-file lock: ``B`` finds the lock stale
    first; ``A`` takes it over; ``B`` moves the lock aside (``A``'s by now) and is slow to put it back; ``C``
    comes in while it is aside."""
    import rbpipe.storage.lock as lock_module

    real_rename = os.rename

    def slow_rename(src, dst, *args, **kwargs):
        if ".stale" in str(dst):
            time.sleep(0.6)
            real_rename(src, dst, *args, **kwargs)
            time.sleep(0.8)
            return None
        return real_rename(src, dst, *args, **kwargs)

    if role == "B":
        lock_module.os.rename = slow_rename  # (the module's os is the os module: this process only)
    start.wait(30)
    time.sleep({"A": 0.3, "B": 0.0, "C": 1.0}[role])
    lock = StoreLock(store)
    try:
        lock.acquire()
    except StoreLockedError as err:
        results.put((role, "refused", str(err)))
        return
    results.put((role, "held", ""))
    done.wait(60)
    held_at_end = lock.path.exists() and json.loads(lock.path.read_text()).get("pid") == os.getpid()
    results.put((role, "still named" if held_at_end else "not named", ""))
    lock.release()


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.mark.timeout(120)
def test_three_processes_taking_over_a_dead_holders_lock_end_with_one_holder(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "since": 0}))
    ctx = multiprocess.get_context("spawn")
    start, done, results = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_contender, args=(str(tmp_path), role, start, results, done)) for role in "ABC"]
    try:
        for p in procs:
            p.start()
        start.set()
        first = [results.get(timeout=60) for _ in procs]  # each took the lock or was refused
        done.set()
        holders = [role for role, what, _ in first if what == "held"]
        final = [results.get(timeout=60) for _ in holders]
        for p in procs:
            p.join(30)
    finally:
        done.set()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    assert len(holders) == 1, f"holders: {holders}; {first}"
    assert final == [(holders[0], "still named", "")]
    refusals = [msg for _, what, msg in first if what == "refused"]
    assert len(refusals) == 2 and all("locked by pid" in m and "\n" not in m for m in refusals), refusals
    assert not (tmp_path / ".lock").exists()
    assert [p.exitcode for p in procs] == [0, 0, 0]


@pytest.mark.timeout(60)
def test_a_holder_in_another_process_is_named_and_its_kill_frees_the_lock(tmp_path):
    code = ("import sys, time; from rbpipe.storage import StoreLock; StoreLock(sys.argv[1]).acquire(); "
            "print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreLockedError, match=f"locked by pid {holder.pid} on host"):
            StoreLock(tmp_path).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        with StoreLock(tmp_path) as lock:  # the kernel released it with the process: no stale lock to judge
            assert lock.held and json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        if holder.stdout is not None:
            holder.stdout.close()
    assert not (tmp_path / ".lock").exists()
