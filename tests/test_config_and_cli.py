"""Configuration validation and the command line's help and plain-words errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rbpipe.cli.commands import build_parser, main
from rbpipe.config import RunConfig
from rbpipe.errors import ConfigError


@pytest.mark.parametrize("kwargs, words", [
    (dict(collectors=0), "--collectors"),
    (dict(grpo_size=1), "--grpo-size"),
    (dict(keep_return_bounds=(0.9, 0.1)), "LOW < HIGH"),
    (dict(candidate_group_size=4, grpo_size=8), "--candidate-group-size"),
    (dict(grouping="fast"), "--grouping"),
    (dict(lr=-1.0), "--lr"),
    (dict(groups_per_step=8, max_lead_groups=3), "wait forever"),
])
def test_impossible_configs_are_rejected_in_plain_words(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        RunConfig(**kwargs)


def test_samples_of_a_prompt_are_split_across_collectors():
    cfg = RunConfig(collectors=3, grpo_size=8)
    assert [cfg.share_of(c) for c in range(3)] == [3, 3, 2]
    assert sum(cfg.share_of(c) for c in range(3)) == cfg.grpo_size


def test_config_round_trips_through_json():
    cfg = RunConfig(keep_return_bounds=(0.1, 0.9), loss={"loss": "dapo"})
    again = RunConfig.from_json(cfg.to_json())
    assert again == cfg


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "rbpipe.cli", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0
    for command in ("run", "inspect", "query", "stress", "export", "view"):
        assert command in out.stdout
    for command in ("run", "inspect", "query", "stress", "export", "view"):
        build_parser().parse_args([command, "x"] if command in ("inspect", "view") else [command, "x", "select 1"]
                                  if command == "query" else
                                  [command, "x", "--zarr", "y"] if command == "export" else [command])


def test_store_path_that_is_a_file_is_a_clear_error(tmp_path, capsys):
    not_a_store = tmp_path / "file.txt"
    not_a_store.write_text("hello")
    code = main(["run", "--store", str(not_a_store), "--no-progress", "--steps", "1",
                 "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert "is a file" in err and "Traceback" not in err


def test_inspect_of_a_path_that_is_not_a_store_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "store" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, target, steps", [
    ([], 0.9, 600),  # the default run stops once the task is learned, 600 steps at most
    (["--steps", "40"], None, 40),  # --steps alone: exactly that many steps
    (["--steps", "40", "--target-reward", "0.8"], 0.8, 40),
    (["--target-reward", "none"], None, 600),
])
def test_the_default_run_stops_at_the_target_and_steps_alone_runs_them_all(argv, target, steps):
    from rbpipe.cli.commands import build_parser, explicit_options, run_config

    parser = build_parser()
    args = parser.parse_args(["run", *argv])
    cfg = run_config(args, explicit_options(parser.run_parser, argv))
    assert (cfg.target_reward, cfg.steps) == (target, steps)


@pytest.mark.parametrize("argv, level", [([], "token"), (["--rollout-is", "none"], None),
                                         (["--rollout-is", "sequence"], "sequence")])
def test_rollout_importance_sampling_is_on_by_default_in_a_run_and_in_the_library(argv, level):
    """A pipeline's learner trains on groups one policy version old: token-level rollout IS corrects for it by
    default, the same in ``rbpipe run`` as in a ``RunConfig`` built in Python (the benchmarks' runs)."""
    from rbpipe.cli.commands import build_parser, explicit_options, run_config
    from rbpipe.config import RunConfig

    parser = build_parser()
    args = parser.parse_args(["run", *argv])
    assert run_config(args, explicit_options(parser.run_parser, argv)).loss_config().rollout_is == level
    assert RunConfig().loss_config().rollout_is == "token"


@pytest.mark.parametrize("command", ["run", "serve"])
def test_the_parser_states_runconfigs_defaults_and_no_others(command):
    """Issue 34: ``rbpipe run``/``serve`` and ``RunConfig`` (with ``LossConfig``) cannot drift apart: an option
    without a value given gives the library's default (the parser keeps literal defaults so that ``rbpipe --help``
    imports no torch; this test is what ties them)."""
    import dataclasses

    from rbpipe.config import RunConfig
    from rbpipe.loss.config import LossConfig

    parser = build_parser()
    args = parser.parse_args([command])
    run_defaults = {f.name: f.default for f in dataclasses.fields(RunConfig) if f.default is not dataclasses.MISSING}
    loss_defaults = {f.name: f.default for f in dataclasses.fields(LossConfig)}
    checked = []
    for dest, value in vars(args).items():
        if value is None or dest in ("command", "steps", "target_reward"):
            continue  # None: "the library decides"; steps and the target: resolved together (tested above)
        if dest in run_defaults:
            assert value == run_defaults[dest], dest
        elif dest in loss_defaults:
            assert value == loss_defaults[dest], dest
        else:
            continue
        checked.append(dest)
    assert {"collectors", "grpo_size", "lr", "max_new_tokens", "groups_per_step", "reward_timeout", "loss",
            "kl_coef", "loss_agg_mode", "rollout_is_mode"} <= set(checked)
