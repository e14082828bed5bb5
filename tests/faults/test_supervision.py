"""Real processes, real signals: the launcher survives dead collectors, stops cleanly on a dead learner or
manager, refuses a second writer, and a killed run resumes with nothing lost.

Every fault fires at a step the run cannot have passed: the learner holds after that step until the test creates a
file (``RBPIPE_TEST_HOLD_AFTER_STEP``, :mod:`rbpipe.system.fault_hooks`), so a fast machine cannot finish the run
first."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rbpipe.system.fault_hooks import HOLD_ENV
from tests.faults.shared_places import assert_nothing_left, private_tmpdir, semaphores_of, session_pids

RUN = [sys.executable, "-m", "rbpipe.cli", "run", "--no-progress", "--grpo-size", "4", "--groups-per-step", "2"]


def start_run(run_dir: Path, *extra: str, hold: tuple[int, Path] | None = None,
              tmpdir: Path | None = None) -> subprocess.Popen:
    """``hold=(N, PATH)``: the learner waits after step N until PATH exists; ``tmpdir``: the run's TMPDIR."""
    env = dict(os.environ, **({"TMPDIR": str(tmpdir)} if tmpdir is not None else {}))
    if hold is not None:
        env[HOLD_ENV] = f"{hold[0]}:{hold[1]}"
    return subprocess.Popen(RUN + ["--run-dir", str(run_dir), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def learner_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def pids(run_dir: Path) -> dict:
    return json.loads((run_dir / "pids.json").read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"run did not end within {timeout}s:\n{out[-3000:]}") from None
    return out


def kill_during_run(run_dir: Path, steps: int, victim: str, after_steps: int, timeout: float):
    """Start a run, SIGKILL worker ``victim`` while the learner holds after step ``after_steps``, release it, wait
    for the run to end. Returns (output, exit code, the workers' pids, seconds from the kill to the end)."""
    release = run_dir.parent / "release"
    proc = start_run(run_dir, "--steps", str(steps), hold=(after_steps, release))
    try:
        wait_for(lambda: learner_steps(run_dir) >= after_steps, 150, f"{after_steps} learner steps")
        assert learner_steps(run_dir) == after_steps  # held there
        workers = pids(run_dir)
        os.kill(workers[victim], signal.SIGKILL)
        t_kill = time.time()
        release.touch()
        out = finish(proc, timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return out, proc.returncode, workers, time.time() - t_kill


def verify_store(store: Path, grpo_size: int = 4) -> list[dict]:
    """Every committed group is whole, homogeneous and correctly normalised; ids are unique."""
    from rbpipe.storage import inspect_store

    groups = inspect_store(store, limit=None)["groups"]
    assert len({g["group_id"] for g in groups}) == len(groups)
    for g in groups:
        returns = torch.tensor(g["returns"], dtype=torch.float64)
        assert len(returns) == grpo_size
        expected = (returns - returns.mean()) / returns.std().clamp_min(1e-6)
        torch.testing.assert_close(torch.tensor(g["advantages"], dtype=torch.float64), expected,
                                   atol=1e-5, rtol=1e-5)
    return groups


@pytest.mark.timeout(300)
def test_sigkilled_collector_is_reported_and_restarted_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "run"
    out, code, _, _ = kill_during_run(run_dir, 30, "collector 0", after_steps=3, timeout=200)
    assert code == 0, out[-3000:]
    assert "collector 0 killed by SIGKILL" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] >= 1 and summary["learner_steps"] == 30
    assert summary["conservation_ok"], summary
    verify_store(run_dir / "store")


@pytest.mark.timeout(300)
def test_sigkilled_learner_stops_the_run_cleanly_and_resume_continues(tmp_path):
    run_dir = tmp_path / "run"
    out, code, workers, seconds = kill_during_run(run_dir, 40, "learner", after_steps=6, timeout=60)
    assert seconds < 45
    assert code == 1 and "learner killed by SIGKILL" in out
    assert not any(alive(pid) for name, pid in workers.items() if pid and name != "launcher"), "orphans left"
    committed = verify_store(run_dir / "store")
    # resume: the learner restarts from its checkpoint, committed groups are still there
    resumed = subprocess.run([sys.executable, "-m", "rbpipe.cli", "run", "--no-progress", "--resume",
                              str(run_dir)], capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = verify_store(run_dir / "store")
    assert {g["group_id"] for g in committed} <= {g["group_id"] for g in after}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner_steps"] == 40


@pytest.mark.timeout(300)
def test_dead_manager_makes_the_run_fail_fast_with_a_clear_message(tmp_path):
    run_dir = tmp_path / "run"
    out, code, workers, seconds = kill_during_run(run_dir, 500, "manager", after_steps=2, timeout=90)
    assert seconds < 60
    assert code != 0
    assert "manager" in out.lower()
    assert not any(alive(pid) for name, pid in workers.items() if pid and name != "launcher"), "orphans left"
    verify_store(run_dir / "store")


@pytest.mark.timeout(300)
def test_second_run_on_the_same_store_is_refused_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, "--steps", "500", hold=(1, tmp_path / "never"))  # it cannot end meanwhile
    try:
        wait_for(lambda: learner_steps(run_dir) >= 1, 150, "the first run to start")
        second = subprocess.run(RUN + ["--run-dir", str(tmp_path / "other"), "--store", str(run_dir / "store"),
                                       "--steps", "1"], capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert str(proc.pid) in second.stderr or "pid" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


@pytest.mark.timeout(420)
def test_whole_run_sigkilled_then_resumed_accounts_for_everything(tmp_path):
    """Every process of the run SIGKILLed at once (no resource tracker is left to clean up either): the resumed
    run accounts for every trajectory, and nothing of either run stays in /dev/shm."""
    run_dir = tmp_path / "run"
    tmpdir = private_tmpdir()  # both runs' socket directories: the resumed run sweeps the killed one's there
    proc = start_run(run_dir, "--steps", "24", hold=(12, tmp_path / "never"), tmpdir=tmpdir)
    try:
        wait_for(lambda: learner_steps(run_dir) >= 12, 150, "12 learner steps (a checkpoint exists)")
        # no process of the run holds a named semaphore (sem.mp-*), which nobody could unlink after the kill
        assert semaphores_of(session_pids(proc.pid)) == set()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    committed = verify_store(run_dir / "store")
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    resumed = subprocess.run([sys.executable, "-m", "rbpipe.cli", "run", "--no-progress", "--resume",
                              str(run_dir)], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, TMPDIR=str(tmpdir)))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    after = verify_store(run_dir / "store")
    assert {g["group_id"] for g in committed} <= {g["group_id"] for g in after}
    assert summary["learner_steps"] == 24 and checkpoint["step"] <= 24
    assert summary["conservation_ok"], summary
    # collectors resume with the checkpoint's policy version, not 0 (which the learner would retire as stale)
    before = {g["group_id"] for g in committed}
    resumed_groups = [g for g in after if g["group_id"] not in before]
    assert resumed_groups and all(min(g["policy_versions"]) > 0 for g in resumed_groups)
    # a weights file or socket directory of the killed run: the next run removes them
    assert_nothing_left([proc.pid], tmpdir)
    shutil.rmtree(tmpdir, ignore_errors=True)
