"""Issue 36's options (``rbpipe.sampling.staleness``): one policy version per group; freshest complete groups first,
with the groups left behind past the lag limit retired and counted (every group trained once, retired, or still
queued)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rbpipe.config import RunConfig
from rbpipe.errors import ConfigError
from rbpipe.grouping.leases import LEASES
from rbpipe.rate_limit import RateLimiter
from rbpipe.sampling import FreshGroupSampler
from rbpipe.sampling.staleness import freshest_first, unit_size, units_per_ask
from rbpipe.service.coordinator import Coordinator
from rbpipe.storage import ArrowStorage
from rbpipe.trajectory import COLLECTOR_KEY, GROUP_KEY, RAGGED_KEYS, VERSION_KEY, make_trajectory
from tests.process_helpers import run_to_summary


def group(gid: int, size: int, version: int):
    from tensordict import lazy_stack

    rows = [row for i in range(size) for row in make_trajectory(
        group_id=gid, prompt=torch.arange(3), response=torch.tensor([4]), rollout_log_probs=torch.zeros(1),
        reward=float(i % 2), collector_id=0, policy_version=version).unbind(0)]
    out = lazy_stack(rows)
    out.set("advantage", torch.zeros(size, 1))
    return out


def store_of(folder, versions: list[int], size: int = 2) -> ArrowStorage:
    storage = ArrowStorage(folder / "store", ragged_keys=RAGGED_KEYS)
    for gid, v in enumerate(versions):
        storage.append_group(group(gid, size, v))
    return storage


def test_freshest_first_takes_the_newest_version_and_commit_order_among_equals(tmp_path):
    storage = store_of(tmp_path, [0, 2, 1, 2, 0, 1])
    sampler = FreshGroupSampler(num_groups=2, order="freshest")
    drawn = []
    while sampler.can_sample(storage):
        index, _ = sampler.sample(storage)
        drawn.append(sorted(set(storage.get(index).get(GROUP_KEY).reshape(-1).tolist())))
    assert drawn == [[1, 3], [2, 5], [0, 4]]
    assert sampler.consumed_groups == 6
    with pytest.raises(ConfigError, match="--sample-order"):
        FreshGroupSampler(num_groups=1, order="newest")


@settings(max_examples=25, deadline=None)
@given(versions=st.lists(st.integers(0, 8), min_size=1, max_size=12), lag=st.integers(0, 3),
       per_batch=st.integers(1, 3), steps=st.lists(st.integers(0, 2), min_size=1, max_size=6))
def test_freshest_first_conserves_every_group(tmp_path_factory, versions, lag, per_batch, steps):
    """Draws interleaved with the learner's version moving on (``steps``): each draw holds the freshest groups still
    available, groups that fell past the lag limit are counted stale, and every group is trained once, counted stale,
    or still available at the end."""
    storage = store_of(tmp_path_factory.mktemp("s"), versions)
    sampler = FreshGroupSampler(num_groups=per_batch, max_staleness=lag, order="freshest")
    trained: list[int] = []
    for advance in steps:
        sampler.consumer_version += advance
        if not sampler.can_sample(storage):
            continue
        waiting = [v for g, v in enumerate(versions) if g not in trained and v >= sampler.consumer_version - lag]
        index, _ = sampler.sample(storage)
        ids = sorted(set(storage.get(index).get(GROUP_KEY).reshape(-1).tolist()))
        assert sorted((versions[g] for g in ids), reverse=True) == sorted(waiting, reverse=True)[:per_batch]
        trained += ids
    left = sampler.available_groups(storage)
    assert len(trained) == len(set(trained)) == sampler.consumed_groups
    assert sampler.consumed_groups + sampler.stale_groups + left == len(versions)
    assert sampler.stale_trajectories == 2 * sampler.stale_groups


def test_freshest_first_is_a_stable_descending_order():
    assert freshest_first(torch.tensor([1, 1, 1])).tolist() == [0, 1, 2]
    assert freshest_first(torch.tensor([0, 3, 1, 3])).tolist() == [1, 3, 2, 0]


def test_whole_group_units_give_each_prompt_to_one_collector(tmp_path):
    cfg = RunConfig(grpo_size=4, groups_per_step=2, collectors=2, one_version_per_group=True)
    assert unit_size(cfg) == 4 and units_per_ask(cfg) == 1
    shared = RunConfig(grpo_size=4, groups_per_step=2, collectors=2)
    assert unit_size(shared) == 2 and units_per_ask(shared) == 2  # off: each prompt split, as before
    coord = Coordinator(4, unit_size(cfg), RateLimiter.settings_for_run(cfg), str(tmp_path), expect_collectors=2)
    try:
        a, b = LEASES.grant(), LEASES.grant()
        coord.join(a), coord.join(b)
        got = [coord.take_many(lease, units_per_ask(cfg)) for lease in (a, b, a, b)]
        assert got == [[{"prompt": 0, "samples": 4}], [{"prompt": 1, "samples": 4}],
                       [{"prompt": 2, "samples": 4}], [{"prompt": 3, "samples": 4}]]
    finally:
        coord.close()


@pytest.mark.timeout(300)
def test_a_run_with_the_options_on_stores_groups_of_one_version_and_conserves(tmp_path):
    run_dir = tmp_path / "run"
    summary = run_to_summary(run_dir, "--steps", "6", "--grpo-size", "4", "--groups-per-step", "2", "--collectors",
                             "2", "--one-version-per-group", "--sample-order", "freshest", "--max-policy-lag", "1")
    assert summary["conservation_ok"] is True and summary["learner_steps"] == 6
    from rbpipe.storage import open_storage

    rows = open_storage(run_dir / "store").get(torch.arange(summary["written"]))
    members: dict[int, set] = {}
    for gid, version, collector in zip(rows.get(GROUP_KEY).reshape(len(rows), -1)[:, 0].tolist(),
                                       rows.get(VERSION_KEY).reshape(len(rows), -1)[:, 0].tolist(),
                                       rows.get(COLLECTOR_KEY).reshape(len(rows), -1)[:, 0].tolist(), strict=True):
        members.setdefault(gid, set()).add((version, collector))
    assert len(members) == summary["groups_written"] >= 12
    assert all(len(m) == 1 for m in members.values()), members  # one collector, one weights version per group
    assert len({c for m in members.values() for _, c in m}) == 2  # both collectors still took prompts
    # every written group was trained, retired as stale (counted) or is still queued for the learner
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = sum(r["groups"] for r in records)
    assert trained + records[-1]["stale_groups"] <= summary["groups_written"]
    assert summary["stale_trajectories"] == records[-1]["stale_groups"] * 4
