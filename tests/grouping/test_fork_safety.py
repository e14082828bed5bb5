"""A child forked by stdlib/torch after its parent talked to the manager must not share the parent's socket
(multiprocess resets proxy connections only in children it forks itself): answers would cross processes."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest

from rbpipe.grouping import SharedMCAdvantage, start_manager
from rbpipe.grouping.manager import call
from tests.grouping.helpers import MINIMAL_KEYS

SECONDS = 1.5  # both processes call the manager during the same window


def _window(start: float):
    """Yield until ``SECONDS`` after ``start`` (a ``time.monotonic`` both processes share)."""
    while time.monotonic() < start:
        time.sleep(0.001)
    while time.monotonic() < start + SECONDS:
        yield


def _pings(transform, manager_pid: int, start: float) -> int:
    """0 when every answer was this process's own (the manager's pid), else 3."""
    for _ in _window(start):
        if call(transform._registry, "ping") != manager_pid:
            return 3
    return 0


def _child_main(transform, manager_pid: int, start: float) -> None:
    """Never returns: an exception must not unwind into the parent's test code in the child."""
    code = 4
    try:
        code = _pings(transform, manager_pid, start)
    finally:
        os._exit(code)


def _parent_stats(transform, errors: list, start: float) -> None:
    try:
        for _ in _window(start):
            stats = transform.get_stats()
            if not isinstance(stats, dict) or "completed_trajectories" not in stats:
                errors.append(stats)
                return
    except Exception as err:  # noqa: BLE001 - reported by the test
        errors.append(err)


def _fork(how: str, transform, manager_pid: int, start: float) -> int:
    """Start the child the way ``how`` says; returns its pid."""
    if how == "os.fork":
        pid = os.fork()
        if pid == 0:
            _child_main(transform, manager_pid, start)
        return pid
    proc = multiprocessing.get_context("fork").Process(target=_child_main, args=(transform, manager_pid, start))
    proc.start()
    return proc.pid


def _wait(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    return None


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["os.fork", "stdlib-fork-context"])
def test_a_forked_child_gets_its_own_manager_connection(how):
    manager = start_manager()
    child = None
    try:
        t = SharedMCAdvantage(2, prompt_key="group_id", manager=manager, required_keys=MINIMAL_KEYS)
        manager_pid = call(t._registry, "ping")  # this thread now holds a connection to the manager
        errors: list = []
        start = time.monotonic() + 1.0
        child = _fork(how, t, manager_pid, start)
        breaker = threading.Timer(40, manager._process.kill)  # a crossed answer can hang this thread's recv
        breaker.start()
        try:
            _parent_stats(t, errors, start)  # on the connection the child inherited
            code = _wait(child, 40)
        finally:
            breaker.cancel()
        assert code == 0, "the child got answers meant for another process (or hung)"
        assert not errors, errors[:1]
        child = None
    finally:
        if child is not None:
            try:
                os.kill(child, 9)
                os.waitpid(child, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        manager._process.kill()
        manager._process.join(10)
