"""Learner metrics through torchrl's loggers: one namespace, files that the tools' own readers load."""

from __future__ import annotations

import json

import pytest

# not importorskip: `pip install -e .[test]` installs tensorboard, and a missing reader must fail this test
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rbpipe.errors import ConfigError
from rbpipe.tracking.metrics_log import MetricsSink, check_logger, scalars

RECORDS = [{"step": s, "time_s": 0.1 * s, "reward_mean": 0.25 * s, "clip_fraction": 0.0, "kl_approx": 1e-3,
            "entropy": 2.5, "train/kl1": 0.0, "learner/busy_fraction": 0.5, "trained_groups": [[s, 8, 1]]}
           for s in (1, 2, 3)]


def test_tensorboard_event_files_load_with_the_loss_names_as_tags(tmp_path):
    with MetricsSink(tmp_path, "tensorboard", exp_name="exp") as sink:
        for r in RECORDS:
            sink.log(r)
    events = list((tmp_path / "logs" / "exp").glob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    acc = EventAccumulator(str(tmp_path / "logs" / "exp"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward_mean", "clip_fraction", "kl_approx", "entropy", "train/kl1", "learner/busy_fraction"} <= tags
    assert "trained_groups" not in tags and "step" not in tags
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]  # the machine-readable record stays


def test_a_resumed_tensorboard_log_shows_each_step_once_with_its_new_value(tmp_path):
    """A resume from the checkpoint of step 1 trains steps 2 and 3 again: TensorBoard must show the new values
    (the old session's events past step 1 purged), not both."""
    with MetricsSink(tmp_path, "tensorboard", exp_name="exp") as sink:
        for r in RECORDS:
            sink.log(r)
    with MetricsSink(tmp_path, "tensorboard", exp_name="exp", start_step=1) as sink:
        for r in RECORDS[1:]:
            sink.log({**r, "reward_mean": 10.0 * r["step"]})
    acc = EventAccumulator(str(tmp_path / "logs" / "exp"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.25), (2, 20.0), (3, 30.0)]


def test_csv_logger_writes_one_file_per_scalar_and_a_resume_does_not_repeat_steps(tmp_path):
    with MetricsSink(tmp_path, "csv", exp_name="exp") as sink:
        for r in RECORDS:
            sink.log(r)
    reward = tmp_path / "logs" / "exp" / "scalars" / "reward_mean.csv"
    assert [ln.split(",")[0] for ln in reward.read_text().splitlines()] == ["1", "2", "3"]
    assert (tmp_path / "logs" / "exp" / "scalars" / "train" / "kl1.csv").exists()
    with MetricsSink(tmp_path, "csv", exp_name="exp", start_step=1) as sink:  # resumed from step 1
        sink.log(RECORDS[1])
    assert [ln.split(",")[0] for ln in reward.read_text().splitlines()] == ["1", "2"]


def test_scalars_are_the_numeric_fields_under_their_own_names():
    assert scalars(RECORDS[0]) == {k: float(v) for k, v in RECORDS[0].items()
                                   if k not in ("step", "trained_groups")}


def test_an_unknown_or_uninstalled_logger_is_refused_before_the_run(monkeypatch):
    with pytest.raises(ConfigError, match="--logger must be one of csv, tensorboard, wandb, mlflow"):
        check_logger("neptune")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install wandb"):
        check_logger("wandb")
    check_logger("csv")
