"""``rbpipe run --task SPEC`` and ``--model PATH``: a user's own task and Hugging Face model directory.

Real runs (subprocesses, children killed with their session) check that collectors use the custom reward
and model and the learner trains that model; in-process calls check that bad specs and directories are
one-line errors (exit code 2) that leave no run directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from rbpipe.demo.policy import PolicyConfig, build_model, build_tokenizer
from rbpipe.trajectory import (
    GROUP_KEY,
    PROMPT_TOKENS_KEY,
    RESPONSE_TOKENS_KEY,
    REWARD_KEY,
    ROLLOUT_LOG_PROBS_KEY,
    VERSION_KEY,
)
from tests.process_helpers import assert_run_refuses, run_cli

RUN = [sys.executable, "-m", "rbpipe.cli", "run", "--no-progress", "--json", "--steps", "3", "--collectors", "1",
       "--groups-per-step", "2", "--grpo-size", "4", "--max-new-tokens", "3"]

# A task unlike the built-in one (which pays 1.0 for copying the first digit): prompts "<bos> a b =" and a
# reward of 0.1 plus 0.25 per response token equal to the prompt's last digit, plus 0.01 x the first response
# token's id. The last term makes the four samples of a group almost never tie (a tie is a zero advantage, so a
# run whose every group tied would leave the weights where they started and the training test below would
# fail for a reason that is not the one it checks).
TASK_FILE = '''
import torch


class LastDigitCount:
    def __init__(self, seed=0):
        self.seed = seed

    def prompt(self, index):
        gen = torch.Generator().manual_seed(self.seed * 7 + index)
        digits = torch.randint(0, 10, (2,), generator=gen)
        return torch.cat([torch.tensor([2]), digits + 4, torch.tensor([3])])

    def reward(self, prompt, response):
        return 0.1 + 0.25 * int((response == prompt[-2]).sum()) + 0.01 * int(response[0])


def bad_prompt():
    class Task:
        def prompt(self, index):
            return [2, 5, 3]

        def reward(self, prompt, response):
            return 0.0
    return Task()


class NoReward:
    def prompt(self, index):
        return torch.tensor([2, 5, 3])


class HugeIds:
    def prompt(self, index):
        return torch.tensor([2, 500, 3])

    def reward(self, prompt, response):
        return 0.0
'''


def custom_reward(prompt: torch.Tensor, response: torch.Tensor) -> float:
    return 0.1 + 0.25 * int((response == prompt[-2]).sum()) + 0.01 * int(response[0])


@pytest.fixture
def task_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_task.py"
    path.write_text(TASK_FILE)
    return path


@pytest.fixture(scope="module")
def custom_run(tmp_path_factory) -> dict:
    """One real run (the costly part: three spawned processes) with both a task file and a saved model:
    the tests below check each half."""
    root = tmp_path_factory.mktemp("custom")
    task_path = root / "my_task.py"
    task_path.write_text(TASK_FILE)
    model_dir = root / "model"
    saved = build_model(PolicyConfig(seed=123))  # same config as the built-in model, other weights
    saved.save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    run_dir = root / "run"
    rc, out, err = run_cli(RUN + ["--run-dir", str(run_dir), "--task", f"{task_path}:LastDigitCount",
                                  "--model", str(model_dir)], timeout=100)
    assert rc == 0, err[-3000:]
    return {"root": root, "task_path": task_path, "model_dir": model_dir, "saved": saved, "run_dir": run_dir,
            "summary": json.loads(out)}


def stored_rows(store: Path):
    from rbpipe.storage import open_storage

    storage = open_storage(store)
    return storage.get(torch.arange(len(storage))).unbind(0)


@pytest.mark.timeout(120)
def test_run_with_a_task_file_stores_the_custom_reward(custom_run):
    summary, run_dir, task_path = custom_run["summary"], custom_run["run_dir"], custom_run["task_path"]
    assert summary["learner_steps"] == 3 and summary["conservation_ok"], summary
    config = json.loads((run_dir / "config.json").read_text())
    assert config["task"] == f"{task_path.resolve()}:LastDigitCount"  # what --resume rebuilds the task from

    sys.path.insert(0, str(task_path.parent))
    try:
        import my_task
    finally:
        sys.path.remove(str(task_path.parent))
    task = my_task.LastDigitCount(seed=0)
    rows = list(stored_rows(Path(summary["store"])))
    assert len(rows) == summary["written"] >= 3 * 2 * 4
    rewards = set()
    for row in rows:
        prompt, response = row.get(PROMPT_TOKENS_KEY).reshape(-1), row.get(RESPONSE_TOKENS_KEY).reshape(-1)
        assert torch.equal(prompt, task.prompt(int(row.get(GROUP_KEY).reshape(-1)[0]))), "prompts by index"
        reward = float(row.get(REWARD_KEY).reshape(-1)[0])
        assert reward == pytest.approx(custom_reward(prompt, response), abs=1e-6)
        rewards.add(round(reward, 4))
    assert rewards - {0.0, 1.0}, "the built-in 0/1 reward was stored instead of the custom one"


@pytest.mark.timeout(120)
def test_run_with_a_saved_model_directory_trains_that_model(custom_run):
    summary, run_dir, saved = custom_run["summary"], custom_run["run_dir"], custom_run["saved"]
    assert summary["learner_steps"] == 3, summary
    assert json.loads((run_dir / "config.json").read_text())["model"] == str(custom_run["model_dir"].resolve())

    # the learner started from the saved weights and changed them
    trained = torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]
    builtin = build_model().state_dict()
    start = saved.state_dict()
    keys = [k for k in start if k in trained]
    assert keys
    moved = sum(float((trained[k] - start[k]).abs().sum()) for k in keys)
    to_builtin = sum(float((trained[k] - builtin[k]).abs().sum()) for k in keys)
    assert 0 < moved < to_builtin

    # the collectors sampled from the saved model: version-0 rollout log-probs are its log-probs
    checked = 0
    with torch.no_grad():
        for row in stored_rows(Path(summary["store"])):
            if int(row.get(VERSION_KEY).reshape(-1)[0]) != 0:
                continue
            prompt, response = row.get(PROMPT_TOKENS_KEY).reshape(-1), row.get(RESPONSE_TOKENS_KEY).reshape(-1)
            logits = saved(input_ids=torch.cat([prompt, response])[None]).logits[0, prompt.numel() - 1:-1]
            expected = torch.log_softmax(logits.float(), -1).gather(-1, response[:, None]).reshape(-1)
            torch.testing.assert_close(row.get(ROLLOUT_LOG_PROBS_KEY).reshape(-1), expected, atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked > 0


def _bad_model_dirs(tmp_path: Path) -> dict[str, Path]:
    empty = tmp_path / "empty"
    empty.mkdir()
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "config.json").write_text("{}")
    no_tokenizer = tmp_path / "no_tokenizer"
    build_model().save_pretrained(no_tokenizer)
    return {"missing": tmp_path / "nowhere", "empty": empty, "garbage": garbage, "no_tokenizer": no_tokenizer}


@pytest.mark.timeout(60)
def test_bad_task_specs_and_model_dirs_are_one_line_errors_before_anything_starts(tmp_path, task_file,
                                                                                    monkeypatch, capsys):

    monkeypatch.chdir(tmp_path)  # a default run directory would appear under ./runs
    cases = [
        (["--task", "no_such_file.py:Task"], "no such file"),
        (["--task", f"{task_file}:Missing"], "defines no 'Missing'"),
        (["--task", "rbpipe.no_such_module:Task"], "no module"),
        (["--task", f"{task_file}:NoReward"], "no reward()"),
        (["--task", f"{task_file}:bad_prompt"], "1-D LongTensor"),
        (["--task", f"{task_file}:HugeIds"], "vocabulary"),
        (["--task", "not-a-spec"], "not a task spec"),
    ]
    for path in _bad_model_dirs(tmp_path).values():
        cases.append((["--model", str(path)], "--model"))
    assert_run_refuses(cases, tmp_path, capsys)


def test_the_built_in_task_is_a_spec_and_specs_survive_the_saved_config(tmp_path, task_file):
    from rbpipe.config import RunConfig
    from rbpipe.demo.task import CopyFirstDigitTask
    from rbpipe.model.task_spec import DEFAULT_TASK, load_task

    assert RunConfig().task == DEFAULT_TASK == "rbpipe.demo.task:CopyFirstDigitTask"
    built = load_task(DEFAULT_TASK, seed=5)
    assert all(torch.equal(built.prompt(i), CopyFirstDigitTask(seed=5).prompt(i)) for i in range(5))
    cfg = RunConfig(task=f"{task_file}:LastDigitCount", model=str(tmp_path / "m"), seed=3)
    cfg.save(tmp_path / "config.json")
    back = RunConfig.from_json(json.loads((tmp_path / "config.json").read_text()))
    assert (back.task, back.model) == (cfg.task, cfg.model)
    assert torch.equal(back.make_task().prompt(7), cfg.make_task().prompt(7))


def test_a_config_saved_before_the_demo_package_loads_its_task_under_the_new_name():
    from rbpipe.config import RunConfig
    from rbpipe.model.task_spec import DEFAULT_TASK, load_task, normalize_spec

    old = "rbpipe.task:CopyFirstDigitTask"  # the built-in task's spec before rbpipe/demo/
    assert RunConfig.from_json({**RunConfig().to_json(), "task": old}).task == DEFAULT_TASK
    assert normalize_spec(old) == DEFAULT_TASK
    assert torch.equal(load_task(old, seed=2).prompt(3), load_task(DEFAULT_TASK, seed=2).prompt(3))


def test_the_example_task_loads_from_its_spec_and_fits_the_built_in_model():
    from rbpipe.model.task_spec import check_task_fits, load_task

    example = Path(__file__).resolve().parents[1] / "examples" / "custom_task.py"
    task = load_task(f"{example}:NextDigitTask", seed=0)
    check_task_fits(task, "example", build_model(), max_new_tokens=3)
    prompt = task.prompt(0)
    right = torch.tensor([4 + (int(prompt[-2]) - 4 + 1) % 10])
    assert task.reward(prompt, right) == 1.0 and task.reward(prompt, right + 1 if right < 13 else right - 1) == 0.0
