"""A stop is clean whatever a learner step costs (issue 33): a real model's step takes ~20 s, the demo's 50 ms.

The learner's steps are made seconds long with the test hook ``RBPIPE_TEST_STEP_DELAY_S`` (every forward pass
of its model sleeps that long, in slices a stop can abandon: ``rbpipe.system.fault_hooks``). The run is then stopped
at a random point (seeded; the seed is printed) by SIGTERM of the launcher, SIGTERM of its whole process group (what
``timeout`` and service managers send) or a double Ctrl-C (SIGINT twice to the group, as a terminal sends it).
Every time: exit status 1 (interrupted) without a traceback or an error line, ``summary.json`` with conservation,
a checkpoint of the last step logged (a resume repeats nothing and skips nothing), no process of the run left, no
writer lock, socket directory or shared-memory file left behind.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.faults.shared_places import assert_nothing_left, private_tmpdir, semaphores_of, session_pids
from tests.faults.test_lifecycle import assert_all_gone, cleanup, steps_logged
from tests.faults.test_supervision import wait_for

RUN = [sys.executable, "-m", "rbpipe.cli", "run", "--no-progress", "--collectors", "1", "--grpo-size", "4",
       "--groups-per-step", "2", "--steps", "1000"]


def _stop(proc: subprocess.Popen, how: str, rng: random.Random) -> None:
    if how == "sigterm":
        os.kill(proc.pid, signal.SIGTERM)
    elif how == "sigterm-group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:  # double Ctrl-C: the second one at a random point of the stop the first one began
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(rng.uniform(0, 3))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)


def stop_at_random_point(tmp_path: Path, how: str, delay_s: float, seed: int, within_s: float,
                         generate_delay_s: float = 0.0) -> tuple[str, dict, Path]:
    """Start a run with slow learner steps, stop it with ``how`` at a random time within ``within_s`` after its
    first step (in a step, in a checkpoint, in the bookkeeping between steps), check what every stop must leave;
    returns the output, the summary and the run directory."""
    rng = random.Random(seed)
    run_dir = tmp_path / "run"
    tmpdir = private_tmpdir()
    env = dict(os.environ, RBPIPE_TEST_STEP_DELAY_S=str(delay_s), RBPIPE_TEST_GENERATE_DELAY_S=str(generate_delay_s),
               TMPDIR=str(tmpdir))
    proc = subprocess.Popen(RUN + ["--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)
    try:
        wait_for(lambda: len(steps_logged(run_dir)) >= 1 or proc.poll() is not None, 240, "a first learner step")
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert semaphores_of(session_pids(proc.pid)) == set()  # nothing a SIGKILLed run could not unlink
        time.sleep(rng.uniform(0, within_s))  # a random point of the run, not the machine's speed: any is right
        stopped_at = time.monotonic()
        _stop(proc, how, rng)
        try:
            out = proc.communicate(timeout=120)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"the launcher did not stop within 120 s:\n{proc.communicate()[0][-3000:]}") from None
        print(f"seed {seed}: {how} {time.monotonic() - stopped_at:.1f} s to stop")
        assert_all_gone(proc.pid)
    finally:
        cleanup(proc)
    # interrupted; or, when the second Ctrl-C landed after the summary, in the interpreter's exit: 130
    # (KeyboardInterrupt) or killed by SIGINT (the default handler is back by then; a shell says 130 for both)
    assert proc.returncode == 1 or (how == "double-sigint" and proc.returncode in (130, -signal.SIGINT)), out[-4000:]
    assert "Traceback" not in out and "error:" not in out, out[-4000:]
    assert f"rbpipe run --resume {run_dir}" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted", summary
    assert summary["conservation_ok"], summary
    assert not (run_dir / "store" / ".lock").exists(), "the writer lock was left"
    logged = steps_logged(run_dir)
    assert logged == list(range(1, len(logged) + 1))
    # the learner finished or abandoned its step, then checkpointed the last one it finished
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["step"] == len(logged) == summary["learner_steps"]
    # a killed worker's own resource tracker unlinks its semaphores once it is gone: wait for that, bounded
    assert_nothing_left([proc.pid], tmpdir)
    shutil.rmtree(tmpdir, ignore_errors=True)
    return out, summary, run_dir


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["sigterm", "sigterm-group", "double-sigint"])
def test_a_run_with_slow_learner_steps_stops_cleanly_at_any_point(tmp_path, how):
    seed = int(os.environ.get("RBPIPE_TEST_SEED", random.randrange(1 << 30)))
    stop_at_random_point(tmp_path, how, 1.5, seed, within_s=4.5)


@pytest.mark.timeout(300)
def test_a_learner_step_longer_than_the_stop_grace_is_abandoned_and_the_last_finished_one_checkpointed(tmp_path):
    """A step longer than the launcher's grace (15 s): the launcher SIGTERMs the learner, which abandons its step
    where safe and checkpoints the last finished step; the groups it had drawn are trained after a resume."""
    from rbpipe.workers.launcher import STOP_GRACE_S

    out, summary, run_dir = stop_at_random_point(tmp_path, "sigterm", STOP_GRACE_S + 5, seed=0, within_s=0)
    assert "learner still running: SIGTERM" in out, out[-3000:]
    assert "SIGKILL" not in out, out[-3000:]
    assert "learner" not in summary["worker_exits"]  # it exited by itself, status 0
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["sampler"]["consumed_groups"] == 2 * checkpoint["step"]  # the abandoned draw went back


@pytest.mark.timeout(300)
def test_a_generation_longer_than_the_stop_grace_is_abandoned_and_the_collector_leaves(tmp_path):
    """A collector generation longer than the launcher's grace, as a real model's round can be: the launcher
    SIGTERMs the collector, which abandons its generation at the next forward pass and leaves by itself (status 0),
    its units back with the service. Its second generation starts once its first is handed over and lasts 60 s;
    the stop comes after the learner's first step and the grace ends 15 s later: it is still generating."""
    from rbpipe.workers.launcher import STOP_GRACE_S

    out, summary, _ = stop_at_random_point(tmp_path, "sigterm", 0, seed=0, within_s=0,
                                           generate_delay_s=4 * STOP_GRACE_S)
    assert "collector 0 still running: SIGTERM" in out, out[-3000:]
    assert "[collector 0] SIGTERM: stop requested: the collector's generation was abandoned" in out, out[-3000:]
    assert "SIGKILL" not in out, out[-3000:]
    assert summary["worker_exits"] == {}, summary["worker_exits"]  # it exited by itself, status 0
