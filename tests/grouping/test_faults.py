"""Killed writers, a dead manager, bad input, resumed queues, and the stock baseline under spawn."""

from __future__ import annotations

import tempfile
import time

import pytest
import torch
from torchrl.objectives.llm import MCAdvantage

from rbpipe.cli.stress import run_stress
from rbpipe.errors import BadTrajectoryError, ManagerDiedError
from rbpipe.grouping import SharedMCAdvantage, start_manager
from tests.grouping.helpers import MINIMAL_KEYS, groups_of, traj


def _transform(manager, **opts):
    return SharedMCAdvantage(prompt_key="group_id", manager=manager, required_keys=MINIMAL_KEYS, **opts)


@pytest.mark.timeout(600)  # four spawned writers: start-up alone may take minutes on a loaded machine
def test_four_writer_stress_run_verifies_from_the_store(tmp_path):
    r = run_stress(writers=4, trajectories=320, group_size=4, seed=3, store=tmp_path / "store",
                   dynamic_sampling=True)
    assert r["ok"], r
    assert r["handed_over"] == 320 and r["written"] + r["dropped"] == 320
    assert r["dropped"] > 0  # degenerate all-0/all-1 groups were dropped, not stored


@pytest.mark.timeout(600)
def test_sigkilled_writers_never_block_the_others_and_conservation_holds(tmp_path):
    r = run_stress(writers=3, trajectories=300, group_size=5, seed=11, kill_rate=0.05, max_kills=2,
                   store=tmp_path / "store")
    assert r["kills"] >= 1, r
    assert not r["hung"]
    assert r["ok"], r
    assert 0 <= r["lost_in_flight"] <= r["kills"]
    assert r["lost"] == 0 and r["duplicated"] == 0 and r["torn_groups"] == 0


@pytest.mark.timeout(60)
def test_dead_manager_raises_manager_died_fast():
    manager = start_manager()
    t = _transform(manager, grpo_size=2, trajectory_return="sum")
    t.inv(traj(0, 0, [1.0]))
    manager._process.kill()
    manager._process.join(10)
    t0 = time.monotonic()
    with pytest.raises(ManagerDiedError, match="manager"):
        t.inv(traj(1, 0, [0.0]))
    with pytest.raises(ManagerDiedError):
        t.get_stats()
    assert time.monotonic() - t0 < 5


@pytest.mark.timeout(60)
def test_bad_trajectory_is_rejected_and_nothing_is_queued(grouping_manager):
    t = _transform(grouping_manager, grpo_size=2, trajectory_return="sum")
    nan = traj(1, 0, [float("nan")])
    missing = traj(2, 0, [1.0]).exclude(("next", "reward"))
    unfinished = traj(3, 0, [1.0, 1.0])
    unfinished.set(("next", "done"), torch.zeros(2, 1, dtype=torch.bool))
    for bad, words in ((nan, "not finite"), (missing, "missing required key"), (unfinished, "unfinished")):
        with pytest.raises(BadTrajectoryError, match=words):
            t.inv(bad)
    # one bad trajectory in a batch rejects the whole batch before anything is shared
    with pytest.raises(BadTrajectoryError):
        t.inv(torch.cat([traj(4, 0, [1.0]), nan]))
    stats = t.get_stats()
    assert stats["completed_trajectories"] == 0 and stats["queued_trajectories"] == 0
    assert t.staging.handles() == []


@pytest.mark.timeout(60)
def test_pending_queues_survive_a_restart(grouping_manager):
    """The one recovery path: a new service (a fresh registry) requeues what is staged on disk, in arrival order."""
    opts = dict(grpo_size=4, trajectory_return="sum")
    first = _transform(grouping_manager, **opts)
    stream = [(0, 7, [1.0]), (1, 7, [0.0]), (2, 8, [1.0]), (3, 7, [0.0])]
    for u, g, r in stream:
        assert first.inv(traj(u, g, r)) is None
    # a new process would build a fresh registry (here: a new name on the same manager) over the same staging
    resumed = SharedMCAdvantage(prompt_key="group_id", manager=grouping_manager, staging_dir=first.staging.path,
                                required_keys=MINIMAL_KEYS, **opts)
    claims, requeued, torn, by_group = resumed.requeue_staged()
    assert (claims, requeued, torn, by_group) == ([], 4, 0, {7: 3, 8: 1})
    assert resumed.get_stats()["queued_trajectories"] == 4
    out = resumed.inv(traj(4, 7, [1.0]))
    ref = MCAdvantage(prompt_key="group_id", **opts)
    want = [groups_of(ref.inv(traj(u, g, r))) for u, g, r in stream + [(4, 7, [1.0])]]
    assert groups_of(out) == want[-1] != []
    assert resumed.get_stats()["completed_trajectories"] == 5  # the 4 requeued count once, with the new one


@pytest.mark.timeout(120)
def test_stock_torchrl_grouping_works_across_multiprocess_spawn_writers(tmp_path):
    r = run_stress(writers=2, trajectories=48, group_size=4, seed=5, grouping="torchrl", store=tmp_path / "store")
    assert r["ok"], r
    assert r["written"] == r["handed_over"] == 48


@pytest.mark.timeout(60)
def test_a_clean_stress_run_removes_its_temporary_store(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = run_stress(writers=2, trajectories=48, group_size=4, seed=5)
    assert r["ok"], r
    assert r["store"] is None and not list(tmp_path.glob("rbpipe-stress-*"))


@pytest.mark.timeout(60)
def test_a_stress_run_into_a_given_store_leaves_no_temporary_directory(tmp_path, monkeypatch):
    """The writers' shares go to a temporary directory of the run's own; the store is the caller's."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    r = run_stress(writers=2, trajectories=48, group_size=4, seed=5, store=tmp_path / "store")
    assert r["ok"] and r["store"] == str(tmp_path / "store"), r
    assert list(scratch.glob("rbpipe-stress-*")) == []
