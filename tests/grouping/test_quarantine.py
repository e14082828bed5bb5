"""A group that cannot be written is quarantined (recorded, counted as dropped, its payloads set aside), not
handed from writer to writer until every one has died; a trajectory that does not fit a torchrl tensor
storage is refused before it reserves rows, so nothing half-written is ever inside ``len(storage)``."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torchrl.data import LazyTensorStorage

from rbpipe.buffer import make_replay_buffer
from rbpipe.errors import BadTrajectoryError, RbpipeError
from rbpipe.grouping import registry as _registry
from rbpipe.grouping.manager import call
from rbpipe.grouping.registry import encode_tensor
from rbpipe.grouping.staging import read_quarantine_record
from rbpipe.storage import ArrowStorage
from tests.grouping.helpers import MINIMAL_KEYS, traj

POISON = 13
MAX_WRITER_DEATHS = getattr(_registry, "MAX_WRITER_DEATHS", 3)


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def _poisoned_buffer(tmp_path, grouping_manager):
    """An Arrow-backed buffer whose storage refuses group ``POISON`` (as a schema mismatch would)."""
    storage = ArrowStorage(tmp_path / "store")
    buffer = make_replay_buffer(storage, grpo_size=2, manager=grouping_manager, staging_dir=tmp_path / "staging",
                                required_keys=MINIMAL_KEYS)
    original = storage.append_group

    def append_group(td, *, commit_id=None, member_ids=None):
        if int(td.get("group_id").reshape(-1)[0]) == POISON:
            raise ValueError("schema mismatch: field 'uid' has type double, the store has int64")
        return original(td, commit_id=commit_id, member_ids=member_ids)

    storage.append_group = append_group
    return buffer, storage


def _append_as(transform, pid: int, td) -> dict:
    """What a writer process ``pid`` does before it writes: stage, then one manager call."""
    handle = transform.staging.put(td)
    reward = encode_tensor(td.get(("next", "reward")))
    return call(transform._registry, "append", transform._group_key(td), handle, reward, pid, False)


def _assert_quarantined(transform, reason: str) -> None:
    stats = transform.get_stats()
    assert stats["dropped_groups"] == 1 and stats["queued_trajectories"] == 0
    assert transform.drop_reasons()["quarantined"] == 1
    (record,) = transform.quarantined()
    assert reason in record["reason"] and record["group"] == POISON and len(record["handles"]) == 2
    kept = transform.staging.path / "quarantine" / record["commit_id"]
    assert sorted(p.suffix for p in kept.iterdir()) == [".json", ".td", ".td"]  # payloads and reason, inspectable
    on_disk = read_quarantine_record(kept)
    assert on_disk["commit_id"] == record["commit_id"] and "claim_id" not in on_disk
    assert transform.staging.handles() == []  # out of the staging namespace: a resume does not queue it again


@pytest.mark.timeout(60)
def test_an_orphaned_claim_that_cannot_be_written_is_quarantined_not_passed_on(tmp_path, grouping_manager):
    buffer, storage = _poisoned_buffer(tmp_path, grouping_manager)
    t = buffer.grouping_transform
    dead = _dead_pid()
    _append_as(t, dead, traj(0, POISON, [1.0]))
    assert _append_as(t, dead, traj(1, POISON, [0.0]))["status"] == "write"  # ... and its writer died
    with pytest.warns(RuntimeWarning, match="quarantined"):
        buffer.recover()  # the healthy writer does not die of it
    _assert_quarantined(t, "schema mismatch")
    assert buffer.recover() == 0  # nobody gets it again
    buffer.extend(traj(2, 1, [1.0]))
    buffer.extend(traj(3, 1, [0.0]))
    stats = t.get_stats()
    assert len(storage) == 2 and stats["written_groups"] == 1
    # conservation: every trajectory handed over is written, dropped with a counted reason, or queued
    assert 4 == len(storage) + 2 * stats["dropped_groups"] + stats["queued_trajectories"]


@pytest.mark.timeout(60)
def test_a_writers_own_unwritable_group_is_quarantined_and_reported(tmp_path, grouping_manager):
    buffer, _ = _poisoned_buffer(tmp_path, grouping_manager)
    t = buffer.grouping_transform
    buffer.extend(traj(0, POISON, [1.0]))
    with pytest.raises(RbpipeError, match="quarantined"):
        buffer.extend(traj(1, POISON, [0.0]))
    _assert_quarantined(t, "schema mismatch")
    assert buffer.recover(force=True) == 0


@pytest.mark.timeout(60)
def test_a_claim_whose_writers_keep_dying_is_quarantined(tmp_path, grouping_manager):
    buffer, storage = _poisoned_buffer(tmp_path, grouping_manager)
    t = buffer.grouping_transform
    first = _dead_pid()
    _append_as(t, first, traj(0, POISON, [1.0]))
    _append_as(t, first, traj(1, POISON, [0.0]))
    for _ in range(MAX_WRITER_DEATHS - 1):  # each writer that took it over died while writing it
        assert len(call(t._registry, "recover", _dead_pid(), False)) == 1
    with pytest.warns(RuntimeWarning, match="quarantined"):
        buffer.recover()
    _assert_quarantined(t, "died")
    assert len(storage) == 0


def _reserved_rows_buffer(tmp_path, grouping_manager):
    storage = LazyTensorStorage(64)
    buffer = make_replay_buffer(storage, grpo_size=2, manager=grouping_manager, staging_dir=tmp_path / "staging",
                                required_keys=MINIMAL_KEYS)
    buffer.extend(traj(0, 0, [1.0]))
    buffer.extend(traj(1, 0, [0.0]))  # allocates the storage from this group
    return buffer, storage


def _renamed(td):
    td = td.exclude("uid")
    td.set("other", torch.ones(td.shape[0]))
    return td


def _retyped(td):
    td.set("uid", td.get("uid").double())
    return td


def _reshaped(td):
    td.set("uid", td.get("uid").reshape(-1, 1).expand(-1, 2).clone())
    return td


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spoil", [_renamed, _retyped, _reshaped], ids=["renamed-key", "dtype", "shape"])
def test_a_trajectory_that_does_not_fit_a_tensor_storage_never_reserves_rows(tmp_path, grouping_manager, spoil):
    buffer, storage = _reserved_rows_buffer(tmp_path, grouping_manager)
    t = buffer.grouping_transform
    with pytest.raises(BadTrajectoryError, match="storage"):
        buffer.extend(spoil(traj(2, 1, [1.0])))
    assert t.get_stats()["queued_trajectories"] == 0
    buffer.extend(traj(4, 2, [1.0]))
    buffer.extend(traj(5, 2, [0.0]))
    rows = storage[: len(storage)]
    assert len(storage) == 4 and sorted(rows.get("uid").tolist()) == [0, 1, 4, 5]  # no hole, nothing half-set
    assert torch.isfinite(rows.get("advantage")).all()


@pytest.mark.timeout(60)
def test_a_write_that_fails_inside_the_storage_leaves_no_uninitialised_rows(tmp_path, grouping_manager):
    buffer, storage = _reserved_rows_buffer(tmp_path, grouping_manager)
    t = buffer.grouping_transform
    original = storage.set

    def half_set(index, data, **kwargs):
        if int(data.get("group_id").reshape(-1)[0]) == POISON:
            storage._storage.get("group_id")[index] = POISON  # part of the group lands, then the storage fails
            storage._storage.get("uid")[index] = -(2 ** 62)
            raise OSError("device error")
        return original(index, data, **kwargs)

    storage.set = half_set
    buffer.extend(traj(2, POISON, [1.0]))
    with pytest.raises(RbpipeError, match="quarantined"):
        buffer.extend(traj(3, POISON, [0.0]))  # rows 2-3
    buffer.extend(traj(4, 2, [1.0, 1.0]))
    buffer.extend(traj(5, 2, [0.0, 1.0]))  # two-step members: rows 4-7, so rows 2-3 are a hole inside the length
    (record,) = t.quarantined()
    assert record["rows"] == 2 and "device error" in record["reason"]
    rows = storage[: len(storage)]
    assert len(storage) == 8 and rows.get("uid").tolist() == [0, 1, 0, 0, 4, 4, 5, 5]  # blanked, not garbage
    assert rows.get("advantage")[2:4].abs().sum() == 0 and torch.isfinite(rows.get("advantage")).all()
    buffer.extend(traj(6, 3, [1.0]))
    buffer.extend(traj(7, 3, [0.0]))  # the next group of two rows fills the hole
    assert storage[: len(storage)].get("uid").tolist() == [0, 1, 6, 7, 4, 4, 5, 5]


@pytest.mark.timeout(60)
def test_one_hand_over_confirms_every_group_it_wrote_in_one_round_trip_even_when_one_fails(
        tmp_path, grouping_manager, monkeypatch):
    """A collector's hand-over completes several groups: it writes them, then confirms them all with one call
    to the manager (a round trip per group was a third of a hand-over's time). A group that cannot be written
    is quarantined, and the groups written beside it are still confirmed: none stays claimed by a live writer."""
    import rbpipe.grouping.transform as transform_module

    buffer, storage = _poisoned_buffer(tmp_path, grouping_manager)
    t = buffer.grouping_transform
    calls: list[str] = []

    def counting_call(proxy, method, *args, **kwargs):
        if method.startswith(("append", "confirm")):  # (not the writer's lease calls)
            calls.append(method)
        return call(proxy, method, *args, **kwargs)

    monkeypatch.setattr(transform_module, "call", counting_call)
    buffer.extend([traj(0, 1, [1.0]), traj(1, 2, [1.0]), traj(2, 3, [0.0])])  # three groups opened
    assert calls == ["append_many"] and t.get_stats()["written_groups"] == 0
    calls.clear()
    buffer.extend([traj(3, 1, [0.0]), traj(4, 2, [0.0]), traj(5, 3, [1.0])])  # ... and completed in one call
    assert calls == ["append_many", "confirm_many"]
    stats = t.get_stats()
    assert len(storage) == 6 and stats["written_groups"] == 3 and stats["queued_trajectories"] == 0
    staged = [p for p in (tmp_path / "staging").rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert not staged, "confirmed groups' staged payloads are deleted"
    calls.clear()
    buffer.extend([traj(6, 4, [1.0]), traj(7, POISON, [1.0]), traj(8, 5, [1.0])])
    with pytest.raises(RbpipeError, match="quarantined"):
        buffer.extend([traj(9, 4, [0.0]), traj(10, POISON, [0.0]), traj(11, 5, [0.0])])
    stats = t.get_stats()
    assert stats["written_groups"] == 5 and stats["dropped_groups"] == 1 and stats["queued_trajectories"] == 0
    assert calls.count("confirm_many") == 1 and "confirm" not in calls


@pytest.mark.timeout(60)
def test_groups_stored_by_a_writer_killed_before_confirming_are_confirmed_at_the_end(tmp_path, grouping_manager,
                                                                                     monkeypatch):
    """A writer killed between storing a hand-over's groups and confirming them leaves them claimed: counted as
    queued although they are in the store (a run's summary then counted them twice, and its conservation
    check failed). The service confirms them once its workers are gone; a claim not stored stays queued."""
    buffer, storage = _poisoned_buffer(tmp_path, grouping_manager)
    t = buffer.grouping_transform
    buffer.extend([traj(0, 1, [1.0]), traj(1, 2, [1.0])])
    monkeypatch.setattr(t, "confirm_many", lambda claims: None)  # killed after writing, before confirming
    buffer.extend([traj(2, 1, [0.0]), traj(3, 2, [0.0])])
    monkeypatch.undo()
    dead = _dead_pid()
    _append_as(t, dead, traj(4, 3, [1.0]))
    assert _append_as(t, dead, traj(5, 3, [0.0]))["status"] == "write"  # claimed by a writer that died unwritten
    stats = t.get_stats()
    assert len(storage) == 4 and stats["written_groups"] == 0 and stats["queued_trajectories"] == 6  # 4 twice
    assert buffer.confirm_stored() == 2
    stats = t.get_stats()
    assert stats["written_groups"] == 2 and stats["queued_trajectories"] == 2  # the unwritten claim stays queued
    assert 6 == len(storage) + stats["queued_trajectories"] + 2 * stats["dropped_groups"]  # conservation
    assert buffer.confirm_stored() == 0


def test_a_quarantine_record_written_before_the_rename_is_read_with_its_commit_id(tmp_path):
    """``reason.json`` named the id ``claim_id`` before it was ``commit_id``: a quarantine an earlier version left
    (e.g. in the staging directory of a run being resumed) still reads, with the new key."""
    kept = tmp_path / "quarantine" / ("ab" * 16)
    kept.mkdir(parents=True)
    old = {"claim_id": "ab" * 16, "group": 7, "reason": "disk full", "handles": ["1-abcdef12/0.td"], "rows": None,
           "time": 1.0}
    (kept / "reason.json").write_text(json.dumps(old))
    record = read_quarantine_record(kept)
    assert record == {**{k: v for k, v in old.items() if k != "claim_id"}, "commit_id": "ab" * 16}
    (kept / "reason.json").write_text(json.dumps(record))  # what this version writes reads back as it is
    assert read_quarantine_record(kept) == record
