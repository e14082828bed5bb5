"""The store's writer lock is an ``flock``: a holder in another process is refused by name, a killed holder's
lock is free at once, and three processes taking over a lock file left by a dead process at the same moment (a
barrier) end with exactly one holder."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import multiprocess
import pytest

from rbpipe.errors import StoreLockedError
from rbpipe.storage import StoreLock


def _contender(store: str, start, results, done) -> None:
    """Take the lock when all three contenders are at ``start`` (a barrier: no sleeps pick an order); report
    ``held``/``refused`` with this pid; a holder keeps it until ``done``, then says whether the file still names
    it."""
    start.wait(30)
    lock = StoreLock(store)
    try:
        lock.acquire()
    except StoreLockedError as err:
        results.put(("refused", str(err), os.getpid()))
        return
    results.put(("held", "", os.getpid()))
    done.wait(60)
    held_at_end = lock.path.exists() and json.loads(lock.path.read_text()).get("pid") == os.getpid()
    results.put(("still named" if held_at_end else "not named", "", os.getpid()))
    lock.release()


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.mark.timeout(120)
def test_three_processes_taking_over_a_dead_holders_lock_end_with_one_holder(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "since": 0}))
    ctx = multiprocess.get_context("spawn")
    start, done, results = ctx.Barrier(3), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_contender, args=(str(tmp_path), start, results, done)) for _ in range(3)]
    try:
        for p in procs:
            p.start()
        first = [results.get(timeout=60) for _ in procs]  # each took the lock or was refused
        holders = [pid for what, _, pid in first if what == "held"]
        assert len(holders) == 1, f"holders: {holders}; {first}"
        # the holder has written its name (it reported after): a newcomer is told who holds the store
        with pytest.raises(StoreLockedError, match=f"locked by pid {holders[0]} on host"):
            StoreLock(tmp_path).acquire()
        done.set()
        final = results.get(timeout=60)
        for p in procs:
            p.join(30)
    finally:
        done.set()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    assert final == ("still named", "", holders[0])
    # a contender refused while the holder was still writing its name is told so; else it is named
    refusals = [msg for what, msg, _ in first if what == "refused"]
    named, writing = f"locked by pid {holders[0]} on host", "is locked by another process (it is writing its name"
    assert len(refusals) == 2 and all((named in m or writing in m) and "\n" not in m for m in refusals), refusals
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
