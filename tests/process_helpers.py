"""Shared by tests that run real processes: the ``rbpipe`` command line as a user runs it (and refuses bad input),
a child that stops itself (SIGSTOP) at the exact point a test fires its fault, a server process stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


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


def run_to_summary(run_dir: Path, *flags: str, timeout: float = 280) -> dict:
    """``rbpipe run --no-progress --run-dir RUN_DIR FLAGS...`` to its end; fails the test with the run's output
    unless it exits 0. Returns its ``summary.json``."""
    code, out, err = run_cli([sys.executable, "-m", "rbpipe.cli", "run", "--no-progress", "--run-dir", str(run_dir),
                              *flags], timeout=timeout)
    assert code == 0, out[-3000:] + err[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


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


def assert_run_refuses(cases: list[tuple[list[str], str]], tmp_path, capsys) -> None:
    """``rbpipe run ARGS`` (in this process) for each ``(ARGS, NAMED)`` of ``cases``: exit 2 with one line
    ``rbpipe run: error: ...`` that names ``NAMED``, before anything is written."""
    from rbpipe.cli import main

    capsys.readouterr()  # what came before (e.g. save_pretrained's progress output)
    for args, expected in cases:
        run_dir = tmp_path / "run"
        rc = main(["run", "--no-progress", "--steps", "1", "--run-dir", str(run_dir), *args])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert rc == 2, (args, err)
        assert len(lines) == 1 and lines[0].startswith("rbpipe run: error: ") and expected in lines[0], (args, err)
        assert not run_dir.exists() and not (tmp_path / "runs").exists(), args


def terminate(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM ``proc`` and wait for it; SIGKILL if it is still there after ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
