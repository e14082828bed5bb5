"""LLM trajectories of varying lengths reach an rbpipe store as one TensorDict of jagged leaves (no lazy stack of
members), with the same rows and advantages torchrl's ``MCAdvantage`` gives the same group in one process."""

from __future__ import annotations

import pytest
import torch
from torchrl.objectives.llm import MCAdvantage

from rbpipe.buffer import make_replay_buffer
from rbpipe.storage import ArrowStorage
from rbpipe.trajectory import RAGGED_KEYS, make_trajectory


def _trajectories(group_size: int, groups: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for gid in range(groups):
        for k in range(group_size):
            n = int(torch.randint(1, 40, (), generator=g))
            out.append(make_trajectory(group_id=gid, prompt=torch.arange(5) + gid,
                                       response=torch.randint(0, 100, (n,), generator=g),
                                       rollout_log_probs=-torch.rand(n, generator=g),
                                       reward=float(torch.rand((), generator=g)), collector_id=k, policy_version=0))
    return out


@pytest.mark.timeout(120)
def test_varying_length_members_are_written_as_jagged_groups_equal_to_torchrl(tmp_path, grouping_manager):
    group_size, trajs = 4, _trajectories(4, 3)
    storage = ArrowStorage(tmp_path / "store", ragged_keys=RAGGED_KEYS)
    buffer = make_replay_buffer(storage, grpo_size=group_size, manager=grouping_manager,
                                staging_dir=tmp_path / "staging")
    seen = []
    original = storage.append_group
    storage.append_group = lambda td, **kw: (seen.append(td), original(td, **kw))[1]
    for t in trajs:
        buffer.extend(t)
    assert len(seen) == 3
    assert all(td.get(("tokens", "response")).is_nested and type(td).__name__ == "TensorDict" for td in seen)

    reference = MCAdvantage(group_size, prompt_key="group_id")
    expected = {}
    for t in trajs:
        out = reference._inv_call(t.clone())
        if out is not None:
            for row in out.unbind(0):
                expected[(int(row["group_id"]), tuple(row["tokens", "response"].tolist()))] = (
                    row["log_probs", "rollout"], float(row["advantage"].reshape(-1)[0]))
    reader = ArrowStorage(tmp_path / "store", create=False, ragged_layout="rows")
    rows = reader.get(torch.arange(len(reader)))
    assert len(rows) == len(expected) == 12
    for row in rows.unbind(0):
        log_probs, advantage = expected[(int(row["group_id"]), tuple(row["tokens", "response"].tolist()))]
        assert torch.equal(row["log_probs", "rollout"], log_probs)
        assert row["advantage"].reshape(-1)[0].item() == pytest.approx(advantage, abs=1e-6)
    buffer.grouping_transform.shutdown()
