"""``FreshGroupSampler`` over a real ArrowStorage: whole groups, each once, stale ones skipped and counted."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrl.data import ReplayBuffer

from rbpipe.sampling import FreshGroupSampler
from rbpipe.storage import ArrowStorage, collate_identity
from rbpipe.trajectory import GROUP_KEY, RAGGED_KEYS, make_trajectory


def group(gid: int, size: int, version: int):
    from tensordict import lazy_stack

    trajs = [make_trajectory(group_id=gid, prompt=torch.arange(2 + (gid + i) % 3), response=torch.tensor([4, 5]),
                             rollout_log_probs=torch.zeros(2), reward=float(i % 2), collector_id=i % 2,
                             policy_version=version) for i in range(size)]
    rows = [row for t in trajs for row in t.unbind(0)]
    out = lazy_stack(rows)
    out.set("advantage", torch.zeros(size, 1))
    return out


def make_storage(tmp_path, versions: list[int], size: int = 4, catalog_columns=None) -> ArrowStorage:
    storage = ArrowStorage(tmp_path / "store", ragged_keys=RAGGED_KEYS, catalog_columns=catalog_columns)
    for gid, v in enumerate(versions):
        storage.append_group(group(gid, size, v))
    return storage


def test_whole_groups_each_trained_once_in_commit_order(tmp_path):
    storage = make_storage(tmp_path, [0] * 6)
    sampler = FreshGroupSampler(num_groups=2)
    rb = ReplayBuffer(storage=storage, sampler=sampler, batch_size=8, collate_fn=collate_identity)
    seen = []
    while sampler.can_sample(storage):
        batch = rb.sample()
        ids = batch.get(GROUP_KEY).reshape(-1).tolist()
        assert len(ids) == 8 and all(ids.count(g) == 4 for g in set(ids)), "groups must come whole"
        seen += sorted(set(ids))
    assert seen == [0, 1, 2, 3, 4, 5]
    assert sampler.consumed_groups == 6


def test_stale_groups_are_skipped_and_counted(tmp_path):
    storage = make_storage(tmp_path, [0, 5, 1, 6])
    sampler = FreshGroupSampler(num_groups=1, max_staleness=2)
    sampler.consumer_version = 7  # groups sampled with versions < 5 are too old
    picked = []
    while sampler.can_sample(storage):
        index, info = sampler.sample(storage)
        picked.append(int(storage.get(index).get(GROUP_KEY).reshape(-1)[0]))
    assert picked == [1, 3]
    assert sampler.stale_groups == 2 and sampler.stale_trajectories == 8


def test_sampler_state_survives_a_restart(tmp_path):
    storage = make_storage(tmp_path, [0] * 4)
    sampler = FreshGroupSampler(num_groups=1)
    sampler.sample(storage)
    sampler.sample(storage)
    state = sampler.state_dict()
    again = FreshGroupSampler(num_groups=1)
    again.load_state_dict(state)
    index, _ = again.sample(ArrowStorage(tmp_path / "store", create=False, ragged_keys=RAGGED_KEYS))
    assert int(storage.get(index).get(GROUP_KEY).reshape(-1)[0]) == 2


@settings(max_examples=25, deadline=None)
@given(versions=st.lists(st.integers(0, 10), min_size=1, max_size=12), lag=st.integers(0, 5),
       consumer=st.integers(0, 12), per_batch=st.integers(1, 3))
def test_every_group_is_either_trained_once_or_counted_stale(tmp_path_factory, versions, lag, consumer, per_batch):
    storage = make_storage(tmp_path_factory.mktemp("s"), versions, size=2)
    sampler = FreshGroupSampler(num_groups=per_batch, max_staleness=lag)
    sampler.consumer_version = consumer
    trained = []
    while sampler.can_sample(storage):
        index, _ = sampler.sample(storage)
        trained += sorted(set(storage.get(index).get(GROUP_KEY).reshape(-1).tolist()))
    fresh = [g for g, v in enumerate(versions) if v >= consumer - lag]
    assert len(trained) == len(set(trained))
    assert set(trained) <= set(fresh)
    assert len(fresh) - len(trained) < per_batch  # only a final partial batch may remain
    assert sampler.stale_groups == len(versions) - len(fresh)


@pytest.mark.parametrize("catalog_columns, column_rows_read", [(None, []), ({}, list(range(16)))],
                         ids=["versions-in-commit-records", "catalogue-without-versions"])
def test_each_groups_policy_version_is_found_once_however_often_the_learner_checks(tmp_path, monkeypatch,
                                                                                 catalog_columns, column_rows_read):
    """A waiting learner checks for fresh groups every few milliseconds. A group's oldest policy version is in its
    commit record (the catalogue values), so no ``policy_version`` data is read at all; a store whose catalogue
    leaves the versions out has each group's column read once, not on every check."""
    storage = make_storage(tmp_path, [0, 1, 2], catalog_columns=catalog_columns)
    read_rows: list[int] = []
    read_column = storage.read_column
    monkeypatch.setattr(storage, "read_column", lambda key, rows: read_rows.extend(rows.tolist()) or
                        read_column(key, rows))
    sampler = FreshGroupSampler(num_groups=2, max_staleness=1)
    for _ in range(5):
        assert sampler.available_groups(storage) == 3
    storage.append_group(group(3, 4, 0))
    sampler.consumer_version = 2  # groups of version 0 are now stale: retired
    assert sampler.available_groups(storage) == 2 and sampler.stale_groups == 2
    assert sorted(read_rows) == column_rows_read


def test_group_minimums_are_the_smallest_member_version_and_only_what_the_records_say(tmp_path):
    storage = ArrowStorage(tmp_path / "store", ragged_keys=RAGGED_KEYS)
    mixed = group(0, 4, 7)
    mixed.set(("policy_version",), torch.tensor([9, 7, 8, 12]))  # members sampled with different versions
    storage.append_group(mixed)
    storage.append_group(group(1, 4, 3))
    spans = storage.group_spans()
    seqs = spans[:, 0].tolist()
    assert storage.group_minimums("policy_version", seqs + [999]) == {seqs[0]: 7, seqs[1]: 3}  # 999: not live
    assert storage.group_minimums(("next", "reward"), seqs) == {}  # floats: a sum is not the value


def test_a_waiting_learner_reports_to_the_service_only_when_it_retired_groups(tmp_path):
    """Groups retired as stale while the learner waits free the collectors' band, so they are reported at once;
    a check that retired nothing sends nothing (it runs every millisecond of a wait)."""
    from rbpipe.workers.learner import _Reports

    class Service:  # what the learner's client sends to the service: recorded
        def __init__(self):
            self.reports = []

        def report(self, **fields):
            self.reports.append(fields)
            return {}

        def collectors_timing(self):
            return {}

    storage = make_storage(tmp_path, [0, 0, 5])
    sampler = FreshGroupSampler(num_groups=4, max_staleness=1)
    service = Service()
    on_wait = _Reports(service, sampler, None, run=lambda fn, *args, **kwargs: fn(*args, **kwargs))
    for _ in range(3):
        sampler.available_groups(storage)
        on_wait.retired_while_waiting()
    assert service.reports == []
    sampler.consumer_version = 3  # the two groups of version 0 turn stale
    for _ in range(3):
        sampler.available_groups(storage)
        on_wait.retired_while_waiting()
    assert [r["stale_groups"] for r in service.reports] == [2]
