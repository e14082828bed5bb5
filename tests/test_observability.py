"""A real run people can watch: ``--json`` stdout, phases on the progress line, TensorBoard events, SQL counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# not importorskip: the test extra installs tensorboard, and a missing reader must fail loudly
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rbpipe.tracking.progress import PHASES

CLI = [sys.executable, "-m", "rbpipe.cli"]


@pytest.fixture(scope="module")
def tb_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("obs") / "run"
    out = subprocess.run(CLI + ["run", "--run-dir", str(run_dir), "--steps", "3", "--collectors", "1",
                                "--groups-per-step", "2", "--json", "--logger", "tensorboard"],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run_dir, out


@pytest.mark.timeout(300)
def test_json_stdout_is_one_object_and_the_rest_goes_to_stderr(tb_run):
    run_dir, out = tb_run
    summary = json.loads(out.stdout)
    assert summary["status"] == "done" and summary["learner_steps"] == 3
    assert "conservation holds" in out.stderr  # the table went to stderr


@pytest.mark.timeout(300)
def test_progress_line_names_the_phases_and_shows_what_moves(tb_run):
    _, out = tb_run
    for name in ("starting processes", "training", "writing the summary"):
        assert name in out.stderr, name
    assert set(PHASES) >= {"starting processes", "compiling kernels", "first groups", "training",
                           "writing the summary"}
    for field in ("reward=", "clip=", "kl=", "entropy=", "groups_written=", "traj_queued="):
        assert field in out.stderr, field
    assert "loss=" not in out.stderr and " written=" not in out.stderr


@pytest.mark.timeout(300)
def test_tensorboard_events_load_with_the_loss_metrics_and_learner_timing(tb_run):
    run_dir, _ = tb_run
    dirs = {p.parent for p in (run_dir / "logs").rglob("events.out.tfevents.*")}
    assert len(dirs) == 1, dirs
    acc = EventAccumulator(str(dirs.pop()))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward_mean", "clip_fraction", "kl_approx", "entropy", "loss", "learner/busy_fraction",
            "learner/policy_lag"} <= tags, tags
    assert [e.step for e in acc.Scalars("reward_mean")] == [1, 2, 3]
    assert all(0.0 < e.value <= 1.0 for e in acc.Scalars("learner/busy_fraction"))
    assert all(e.value >= 0.0 for e in acc.Scalars("learner/policy_lag"))


@pytest.mark.timeout(300)
def test_sql_count_of_trajectories_equals_the_summarys_written(tb_run):
    run_dir, out = tb_run
    summary = json.loads(out.stdout)
    q = subprocess.run(CLI + ["query", str(run_dir / "store"), "select count(*) as n from trajectories", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert q.returncode == 0, q.stderr
    assert json.loads(q.stdout)["rows"] == [{"n": summary["written"]}]
    text = subprocess.run(CLI + ["query", str(run_dir / "store"), "select count(*) from trajectories"],
                          capture_output=True, text=True, timeout=60).stdout
    assert str(summary["written"]) in text.split()


def test_phase_follows_the_learners_published_phase_then_its_steps():
    from rbpipe.tracking.progress import LEARNER_COMPILING, LEARNER_READY, LEARNER_STARTING, phase

    assert phase(LEARNER_STARTING, 0, 0) == "starting processes"
    assert phase(LEARNER_COMPILING, 0, 0) == "compiling kernels"
    assert phase(LEARNER_READY, 0, 0) == "first groups"
    assert phase(LEARNER_READY, 1, 0) == "training"
    assert phase(LEARNER_STARTING, 7, 7) == "starting processes"  # a resumed run starts at its checkpoint's step


def test_reward_plot_gets_a_timing_panel_once_busy_fraction_and_lag_are_measured(tmp_path):
    import matplotlib.image

    from rbpipe.tracking.report import plot_rewards

    plain = [{"step": i, "reward_mean": 0.1 * i} for i in range(1, 6)]
    timed = [dict(r, **{"learner/busy_fraction": 0.5, "learner/policy_lag": 1.0}) for r in plain]
    h_plain = matplotlib.image.imread(plot_rewards(plain, tmp_path / "a.png")).shape[0]
    h_timed = matplotlib.image.imread(plot_rewards(timed, tmp_path / "b.png")).shape[0]
    assert h_timed > h_plain
