"""Group stores used the torchrl way (issue 15, item 9): a plain ``ReplayBuffer`` over them samples with
torchrl's default collate; its default writer and non-TensorDict data fail with a clear error."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import RandomSampler, ReplayBuffer

from rbpipe.errors import NotAGroupError, SchemaError, StoreError
from rbpipe.storage import ArrowStorage, GroupWriter, ZarrStorage, group_buffer

BACKENDS = [ArrowStorage, ZarrStorage]


def _group(n: int = 3, base: float = 0.0) -> TensorDict:
    return TensorDict(a=torch.arange(n, dtype=torch.float32) + base, batch_size=[n])


@pytest.mark.parametrize("cls", BACKENDS)
def test_plain_replay_buffer_uses_default_collate(tmp_path, cls):
    rb = ReplayBuffer(storage=cls(tmp_path / "s"), sampler=RandomSampler(), batch_size=4)
    rb.extend(_group(3))
    rb.extend(_group(3, base=10))
    sample = rb.sample()
    assert isinstance(sample, TensorDict) and sample.shape == (4,)
    assert set(sample["a"].tolist()) <= {0.0, 1.0, 2.0, 10.0, 11.0, 12.0}


@pytest.mark.parametrize("cls", BACKENDS)
def test_group_buffer_factory(tmp_path, cls):
    rb = group_buffer(cls(tmp_path / "s", max_size=4), batch_size=2)
    for i in range(5):  # retention evicts: a round-robin writer would fail here, GroupWriter does not
        rb.extend(_group(2, base=10 * i))
    assert isinstance(rb._writer, GroupWriter)
    assert set(rb.sample()["a"].tolist()) <= {30.0, 31.0, 40.0, 41.0}
    rb2 = group_buffer(tmp_path / "s")  # a path opens the store
    assert len(rb2) == 4


@pytest.mark.parametrize("cls", BACKENDS)
def test_round_robin_writer_wrap_is_a_clear_error(tmp_path, cls):
    store = cls(tmp_path / "s", max_size=8)
    rb = ReplayBuffer(storage=store, batch_size=2)  # torchrl's default RoundRobinWriter
    rb.extend(_group(3))
    rb.extend(_group(3))
    with pytest.raises(StoreError, match="GroupWriter"):
        rb.extend(_group(3))  # rows [6, 7, 0]: wraps around
    assert len(store) == 6


@pytest.mark.parametrize("writer", [None, GroupWriter])
@pytest.mark.parametrize("data", [torch.arange(3.0), [1, 2], [TensorDict(a=torch.ones(2), batch_size=[2])]],
                         ids=["tensor", "list", "list-of-tds"])
def test_non_tensordict_data_is_a_clear_error(tmp_path, writer, data):
    kwargs = {"writer": writer()} if writer else {}
    rb = ReplayBuffer(storage=ArrowStorage(tmp_path / "s"), **kwargs)
    with pytest.raises(NotAGroupError, match="TensorDict") as err:
        rb.extend(data)
    assert isinstance(err.value, (SchemaError, TypeError))
    assert (tmp_path / "s" / "commits.jsonl").read_bytes() == b""


def test_tensorclass_groups_are_still_accepted(tmp_path):
    from tensordict import tensorclass

    @tensorclass
    class Group:
        a: torch.Tensor

    store = ArrowStorage(tmp_path / "s")
    store.append_group(Group(a=torch.ones(3), batch_size=[3]))
    assert store.get(slice(0, 3))["a"].tolist() == [1.0, 1.0, 1.0]
