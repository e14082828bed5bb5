"""Bad input is refused in one line before anything is written (issue 16, items 2 and 3); no hangs, no
silent success, no silent data mixing."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from rbpipe.cli.commands import main
from rbpipe.config import RunConfig
from rbpipe.demo.policy import build_learner_actor, build_model
from rbpipe.errors import ConfigError
from rbpipe.loss import LossConfig, build_loss_batch, make_loss, step_counts


def one_line_error(capsys, code: int, expected_code: int, *words: str) -> str:
    err = capsys.readouterr().err
    assert code == expected_code, err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err
    return err


def test_negative_max_policy_lag_is_rejected():
    with pytest.raises(ConfigError, match="--max-policy-lag"):
        RunConfig(max_policy_lag=-1)


@pytest.mark.parametrize("argv, words", [
    (["--writers", "0"], "--writers"),
    (["--trajectories", "-5"], "--trajectories"),
    (["--kill-rate", "1.5"], "--kill-rate"),
    (["--group-size", "1"], "--group-size"),
])
def test_stress_rejects_impossible_arguments_in_one_line(argv, words, capsys):
    code = main(["stress", *argv])
    one_line_error(capsys, code, 2, words)


def test_inspect_of_an_unknown_group_says_so_and_fails(tmp_path, capsys):
    from rbpipe.cli.stress import _open_storage

    _open_storage(tmp_path / "store").close()
    code = main(["inspect", str(tmp_path / "store"), "--group", "999999"])
    out = capsys.readouterr()
    assert code != 0
    assert "999999" in out.err and "no group" in out.err and "Traceback" not in out.err


def test_store_that_is_a_file_leaves_no_run_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file.txt").write_text("x")
    code = main(["run", "--store", "file.txt", "--no-progress", "--steps", "1"])
    one_line_error(capsys, code, 2, "is a file")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("kwargs", [dict(dual_clip=math.nan), dict(kl_coef=math.inf), dict(agg_norm=math.inf),
                                    dict(eps_high=math.inf), dict(eps_low=math.nan), dict(entropy_coef=math.inf)])
def test_loss_config_rejects_non_finite_numbers(kwargs):
    with pytest.raises(ConfigError, match=next(iter(kwargs)).replace("_", ".?")):
        LossConfig(**kwargs)


@pytest.mark.parametrize("argv, words", [
    (["--rollout-is-veto", "0.1", "10"], "--rollout-is-veto"),
    (["--rollout-is-mode", "mask"], "--rollout-is-mode"),
    (["--rollout-is-threshold", "0.5", "2"], "--rollout-is-threshold"),
])
def test_rollout_is_options_with_rollout_is_off_are_errors(argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--no-progress", "--steps", "1", "--rollout-is", "none", *argv])
    one_line_error(capsys, code, 2, words, "--rollout-is")
    assert not (tmp_path / "runs").exists()


def test_seq_mean_token_sum_norm_divides_by_the_generation_budget():
    """Dr.GRPO's constant is the run's max new tokens: never the longest response of the step."""
    from tests.loss.test_loss_module import rows

    model = build_model()
    actor = build_learner_actor(model)
    cfg = RunConfig(max_new_tokens=7, loss={"loss_agg_mode": "seq-mean-token-sum-norm"})
    loss = make_loss(actor, cfg.loss_config())
    batch = build_loss_batch(rows(model), actor=actor)  # responses of 1-3 tokens
    assert step_counts(loss, batch)["norm"] == 7.0
    assert step_counts(loss, batch[:4])["norm"] == 7.0


def test_resume_refuses_while_a_process_of_the_old_run_lives(tmp_path, capsys):
    """The pids file names live processes (here: this test itself, with its start time): refuse."""
    from rbpipe.workers.launcher import write_pids

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunConfig(steps=1).save(run_dir / "config.json")
    (run_dir / "run.json").write_text(json.dumps({"store": str(run_dir / "store")}))
    write_pids(run_dir, {"launcher": os.getpid()})
    code = main(["run", "--resume", str(run_dir), "--no-progress"])
    one_line_error(capsys, code, 2, "still running", str(os.getpid()))
    assert not (run_dir / "store").exists()


def test_resume_ignores_a_reused_pid(tmp_path, capsys):
    """A recorded pid that now belongs to another process (other start time) is not the old run."""
    from rbpipe.workers.launcher import PID_STARTS, runs_alive, write_pids

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_pids(run_dir, {"launcher": os.getpid()})
    (run_dir / PID_STARTS).write_text(json.dumps({"launcher": 1}))
    assert runs_alive(run_dir) == {}


def make_store(path: Path, grpo_size: int = 4, groups: int = 2) -> Path:
    """A store with a few whole groups, written in this process (no pipeline run needed)."""
    from tensordict import lazy_stack

    from rbpipe.cli.stress import _open_storage, make_payload_trajectory

    storage = _open_storage(path)
    for g in range(groups):
        rows = [make_payload_trajectory(g * grpo_size + m, g, float(m % 2), "small", 0) for m in range(grpo_size)]
        storage.append_group(lazy_stack([r[0] for r in rows]))
    storage.close()
    return path


@pytest.fixture
def old_run(tmp_path) -> Path:
    """What a finished run leaves for the checks below: its configuration, run.json and a store of groups of 4."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunConfig(grpo_size=4, collectors=1, steps=2).save(run_dir / "config.json")
    store = make_store(run_dir / "store")
    (run_dir / "run.json").write_text(json.dumps({"store": str(store)}))
    return run_dir


def test_run_dir_of_an_existing_run_is_refused_before_anything_is_written(old_run, capsys):
    before = sorted(p.name for p in old_run.iterdir())
    config = (old_run / "config.json").read_text()
    code = main(["run", "--no-progress", "--grpo-size", "8", "--run-dir", str(old_run), "--steps", "2"])
    one_line_error(capsys, code, 2, "--resume", str(old_run))
    assert sorted(p.name for p in old_run.iterdir()) == before
    assert (old_run / "config.json").read_text() == config


def test_store_of_another_group_size_is_refused(old_run, tmp_path, capsys):
    code = main(["run", "--no-progress", "--grpo-size", "8", "--run-dir", str(tmp_path / "other"),
                 "--store", str(old_run / "store"), "--steps", "2"])
    one_line_error(capsys, code, 2, "--grpo-size", "groups of 4")
    assert not (tmp_path / "other").exists()
    assert not (old_run / "store" / ".lock").exists()


@pytest.mark.parametrize("flag", [["--collectors", "2"], ["--store", "elsewhere"], ["--run-dir", "elsewhere"],
                                  ["--backend", "zarr"], ["--grpo-size", "8"]])
def test_resume_refuses_options_it_would_ignore(old_run, flag, capsys):
    code = main(["run", "--resume", str(old_run), "--no-progress", *flag])
    one_line_error(capsys, code, 2, flag[0], "--resume")


def test_export_twice_to_one_output_is_refused(tmp_path, capsys):
    from rbpipe.storage import inspect_store

    store = make_store(tmp_path / "store")
    out = tmp_path / "out.zarr"
    assert main(["export", str(store), "--zarr", str(out)]) == 0
    capsys.readouterr()
    code = main(["export", str(store), "--zarr", str(out)])
    one_line_error(capsys, code, 2, str(out))
    assert inspect_store(out, limit=None)["groups_committed"] == inspect_store(store)["groups_committed"] == 2


def test_resume_drops_metrics_past_the_checkpoint(tmp_path):
    """Steps after the checkpoint are trained again on resume: each must be logged once (a torn line goes)."""
    from rbpipe.tracking.metrics_log import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "rew')
    truncate_metrics(path, 3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


@pytest.mark.parametrize("argv, words", [
    (["--grouping-shards", "2"], ("--grouping-shards", "--engine ray")),
    (["--ray-address", "127.0.0.1:1"], ("--ray-address", "--engine ray")),
    (["--engine", "ray", "--grouping-shards", "0"], ("--grouping-shards", ">= 1")),
    (["--engine", "ray", "--ray-resources", "[1]"], ("--ray-resources",)),
])
def test_ray_engine_options_are_checked_in_one_line(argv, words, tmp_path, capsys):
    code = main(["run", "--no-progress", "--run-dir", str(tmp_path / "r"), *argv])
    one_line_error(capsys, code, 2, *words)
    assert not (tmp_path / "r").exists()


class _RunsCodeWhenUnpickled:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_resume_refuses_a_checkpoint_that_is_not_tensors_and_plain_values(tmp_path, capsys):
    """Nothing read back from disk is unpickled: a checkpoint holding an object is refused in one line, before
    the run directory or the store is touched, and the object's code never runs."""
    import torch

    from rbpipe.config import RunConfig

    run_dir, marker = tmp_path / "run", tmp_path / "code-ran"
    run_dir.mkdir()
    RunConfig().save(run_dir / "config.json")
    (run_dir / "run.json").write_text(json.dumps({"store": str(tmp_path / "store")}))
    torch.save({"step": 3, "model": {}, "extra": _RunsCodeWhenUnpickled(marker)}, run_dir / "checkpoint.pt")
    before = sorted(p.name for p in run_dir.iterdir())
    code = main(["run", "--no-progress", "--resume", str(run_dir)])
    one_line_error(capsys, code, 2, "checkpoint", "plain values")
    assert not marker.exists()
    assert sorted(p.name for p in run_dir.iterdir()) == before and not (tmp_path / "store").exists()
