"""Shared by tests that run real processes: the ``rbpipe`` command line as a user runs it, and a child that stops
itself (SIGSTOP) at the exact point a test fires its fault."""

from __future__ import annotations

import os
import signal
import subprocess
import time


def run_cli(args: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, str]:
    """Run ``args`` (``rbpipe ...``) in its own session with ``env`` added to this environment; whatever happens,
    the launcher and its workers are killed. Returns the exit status, stdout and stderr."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return proc.returncode, out, err


def wait_stopped(pid: int, timeout: float) -> bool:
    """Until the child ``pid`` has stopped itself (an event, not a delay); False if it exited or ``timeout`` (a
    bound for a test that would otherwise hang) ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG | os.WUNTRACED)
        if done:
            return os.WIFSTOPPED(status)
        time.sleep(0.02)
    return False
