"""Reads return exactly the groups that were drawn: a refresh of the store between a draw and its read (an
eviction by another writer, seen by the sampler's own bookkeeping, by a failed ``get()`` or by anything else)
never makes the drawn row numbers read other groups. Forced, step by step, with real stores and two handles."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import ReplayBuffer

from rbpipe.errors import StaleReadError
from rbpipe.sampling import FreshGroupSampler
from rbpipe.storage import ArrowStorage, ZarrStorage, collate_identity
from rbpipe.storage.ledger import scan

BACKENDS = [ArrowStorage, ZarrStorage]
#: floats per row of the groups whose files retention deletes: ~5 MB a group, so every Arrow commit seals its
#: segment and every Zarr row chunk holds one group
BIG = 300_000


def group(gid: int, width: int = 8) -> TensorDict:
    """Group ``gid``: 4 members if ``gid`` is even, 3 if odd (unequal sizes: a shifted numbering tears groups)."""
    n = 4 if gid % 2 == 0 else 3
    return TensorDict({"group_id": torch.full((n,), gid), "member": torch.arange(n),
                       "obs": torch.full((n, width), float(gid)), "policy_version": torch.zeros(n, dtype=torch.int64)},
                      batch_size=[n])


def gid_of_seq(path) -> dict[int, int]:
    return {seq: rec["gid"] for seq, rec in scan(path).groups.items()}


def check_exact(td, seqs: list[int], path) -> list[int]:
    """The batch ``td`` holds exactly the groups ``seqs`` (whole, in order, each row its own member)."""
    gids = [gid_of_seq(path)[s] for s in seqs]
    want = [g for g in gids for _ in range(4 if g % 2 == 0 else 3)]
    got = td["group_id"].tolist()
    assert got == want, f"drew the groups {gids}, read group_id {got}"
    assert torch.equal(td["obs"][:, 0], torch.tensor([float(g) for g in want]))
    return gids


@pytest.mark.parametrize("cls", BACKENDS)
def test_an_eviction_between_the_samplers_draw_and_the_read_does_not_shift_the_drawn_rows(tmp_path, cls, monkeypatch):
    """``consume=True`` (the learner's default): the sampler used to refresh the store after drawing (its
    watermark), so the buffer's ``get`` read the drawn row numbers under the numbering after the eviction."""
    path = tmp_path / "s"
    writer = cls(path, max_size=14)
    for gid in range(4):  # 14 rows: groups 0..3
        writer.append_group(group(gid))
    reader = cls(path, create=False)
    sampler = FreshGroupSampler(num_groups=1)
    rb = ReplayBuffer(storage=reader, sampler=sampler, batch_size=4, collate_fn=collate_identity)
    hold = reader.hold
    evicted = []

    def hold_after_an_eviction(index, **kwargs):  # another writer commits (and evicts) right after the draw
        if not evicted:
            writer.append_group(group(4))
            evicted.append(True)
        return hold(index, **kwargs)

    monkeypatch.setattr(reader, "hold", hold_after_an_eviction)
    td, info = rb.sample(return_info=True)
    assert evicted
    check_exact(td, info["group_seq"].tolist(), path)
    seen = [gid_of_seq(path)[int(info["group_seq"][0])]]
    while sampler.can_sample(reader):  # the rest, each exactly once
        td, info = rb.sample(return_info=True)
        seen += check_exact(td, info["group_seq"].tolist(), path)
    assert seen == sorted(set(seen)) and seen[-1] == 4


@pytest.mark.parametrize("cls", BACKENDS)
def test_a_get_that_raised_stale_leaves_other_rows_of_the_same_draw_readable_as_drawn(tmp_path, cls):
    """Two index sets drawn from one ``len()``: the first ``get`` finds its group evicted and deleted
    (StaleReadError, after reading the log); the second must still read the group it named, not the rows of
    that number under the log's new numbering."""
    path = tmp_path / "s"
    writer = cls(path, max_size=16)
    big = BIG
    for gid in range(0, 8, 2):
        writer.append_group(group(gid, width=big))
    reader = cls(path, create=False)
    assert len(reader) == 16
    first, last = torch.arange(0, 4), torch.arange(12, 16)  # groups 0 and 6
    for gid in range(8, 16, 2):  # four more groups: 0..6 evicted, their files deleted
        writer.append_group(group(gid, width=big))
    with pytest.raises(StaleReadError):
        reader.get(first)
    try:
        td = reader.get(last)
    except StaleReadError:
        return  # also exact: the group is gone, and the caller is told so
    assert td["group_id"].tolist() == [6] * 4, f"rows 12..15 were group 6 when drawn; read {td['group_id'].tolist()}"


@pytest.mark.parametrize("cls", BACKENDS)
def test_read_column_reads_the_rows_of_the_draw_after_a_failed_get(tmp_path, cls):
    path = tmp_path / "s"
    writer = cls(path, max_size=16)
    big = BIG
    for gid in range(0, 8, 2):
        writer.append_group(group(gid, width=big))
    reader = cls(path, create=False)
    assert len(reader) == 16
    for gid in range(8, 16, 2):
        writer.append_group(group(gid, width=big))
    with pytest.raises(StaleReadError):
        reader.get(torch.arange(0, 4))
    try:
        col = reader.read_column("group_id", torch.arange(12, 16))
    except StaleReadError:
        return
    assert col.tolist() == [6] * 4
