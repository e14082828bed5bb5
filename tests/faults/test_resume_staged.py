"""A run killed after a collector staged samples and before the service recorded them as handed over
(``prompts.json``): the resumed service requeues them from staging, and must not ask for them again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from rbpipe.demo.policy import DIGIT0_ID
from rbpipe.demo.task import CopyFirstDigitTask
from rbpipe.grouping.staging import Staging
from rbpipe.storage import inspect_store
from rbpipe.trajectory import GROUP_KEY, make_trajectory

RUN = [sys.executable, "-m", "rbpipe.cli", "run", "--no-progress", "--json"]


def _run(*args: str) -> dict:
    done = subprocess.run([*RUN, *args], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.timeout(300)
def test_samples_staged_but_not_recorded_before_a_kill_are_not_asked_for_again(tmp_path):
    run = tmp_path / "run"
    first = _run("--run-dir", str(run), "--collectors", "2", "--grpo-size", "4", "--groups-per-step", "2",
                 "--steps", "2")
    assert first["conservation_ok"]
    # The kill's footprint: collector 0 staged its unit of a new prompt (2 of its 4 samples); the service had
    # opened the prompt but not yet recorded the hand-over, so prompts.json still owes all 4 samples.
    state = json.loads((run / "prompts.json").read_text())
    prompt = state["next_prompt"]
    state["next_prompt"], state["todo"][str(prompt)] = prompt + 1, 4
    (run / "prompts.json").write_text(json.dumps(state))
    staging = Staging(run / "store" / "staging")
    task = CopyFirstDigitTask(seed=0)
    for digit in (3, 4):
        response = torch.tensor([DIGIT0_ID + digit])
        staging.put(make_trajectory(group_id=prompt, prompt=task.prompt(prompt), response=response,
                                    rollout_log_probs=torch.zeros(1), reward=0.0, collector_id=0, policy_version=0))

    resumed = _run("--resume", str(run), "--steps", "8")
    assert resumed["conservation_ok"] and resumed["session"]["requeued_at_start"] >= 2
    groups = inspect_store(run / "store", limit=None)["groups"]
    assert [g["members"] for g in groups if g["group_id"] == prompt] == [4]  # the staged 2 and 2 new ones
    still_staged = [int(staging.load(h).get(GROUP_KEY).reshape(-1)[0]) for h in Staging(staging.path).handles()]
    assert prompt not in still_staged  # no surplus samples of the prompt left queued (they formed a 2nd group)
    assert len(groups) == len({g["group_id"] for g in groups})
