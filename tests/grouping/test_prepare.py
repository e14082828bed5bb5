"""Splitting, group ids and rewards on the wire come out the same whether a leaf takes the numpy fast path
or torch's ops (bfloat16, tensors that require grad)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from rbpipe.grouping import SharedMCAdvantage
from rbpipe.grouping.registry import decode_tensor, encode_tensor

_SELF = SimpleNamespace(prompt_key="group_id", done_key=("next", "done"), rewards_key=("next", "reward"),
                        required_keys=("group_id",))


def _trajectory(group: torch.Tensor, done: torch.Tensor) -> TensorDict:
    steps = done.shape[0]
    return TensorDict({"group_id": group, "next": TensorDict(done=done, reward=torch.zeros(steps, 1),
                                                            batch_size=[steps])}, batch_size=[steps])


@pytest.mark.parametrize("group", [
    torch.full((3,), 7, dtype=torch.int64), torch.full((3,), 7, dtype=torch.int32),
    torch.full((3,), 0.5), torch.ones(3, dtype=torch.bool), torch.tensor([[1, 2]] * 3),
    torch.full((3,), 0.25, requires_grad=True), torch.full((3,), 0.5, dtype=torch.bfloat16),
], ids=["int64", "int32", "float32", "bool", "pair", "requires_grad", "bfloat16"])
def test_group_id_is_the_first_steps_value_whatever_its_dtype(group):
    done = torch.zeros(3, 1, dtype=torch.bool)
    done[-1] = True
    first = group[0].detach()
    expected = first.item() if first.numel() == 1 else tuple(first.reshape(-1).tolist())
    got = SharedMCAdvantage._group_key(_SELF, _trajectory(group, done))
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.bfloat16])
def test_back_to_back_trajectories_are_split_at_every_done_step(dtype):
    done = torch.tensor([0, 1, 0, 0, 1, 1, 0], dtype=dtype).reshape(7, 1)  # the last one unfinished
    td = _trajectory(torch.arange(7), done)
    parts = SharedMCAdvantage.split_trajectories(_SELF, td)
    assert [p.shape[0] for p in parts] == [2, 3, 1, 1]
    assert torch.equal(torch.cat([p["group_id"] for p in parts]), torch.arange(7))


@pytest.mark.parametrize("reward", [
    torch.rand(4, 1), torch.rand(3, 4).t(), torch.rand(2, dtype=torch.float64),
    torch.rand(3, 1).bfloat16(), torch.rand(2, 1, requires_grad=True),
], ids=["float32", "transposed", "float64", "bfloat16", "requires_grad"])
def test_rewards_reach_the_manager_bit_exact(reward):
    data, dtype, shape = encode_tensor(reward)
    back = decode_tensor(data, dtype, shape)
    assert back.dtype == reward.dtype and back.shape == reward.shape
    assert torch.equal(back, reward.detach())
