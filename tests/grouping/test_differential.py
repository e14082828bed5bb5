"""Our shared transform decides exactly like torchrl's MCAdvantage fed the same per-group arrival order."""

from __future__ import annotations

import multiprocess
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrl.data import LazyMemmapStorage
from torchrl.objectives.llm import MCAdvantage, MCAdvantageSelector

from rbpipe.buffer import allocate_storage, make_replay_buffer
from rbpipe.grouping import SharedMCAdvantage
from tests.grouping.helpers import MINIMAL_KEYS, groups_of, traj, writer_main

REWARD = st.sampled_from([0.0, 1.0, 0.25, 0.5, -1.0])


@st.composite
def scenarios(draw):
    mode = draw(st.sampled_from([None, "sum", "max", "mean"]))
    grpo_size = draw(st.integers(2, 4))
    opts = dict(grpo_size=grpo_size, trajectory_return=mode)
    if mode is not None:
        if draw(st.booleans()):
            opts["keep_return_bounds"] = (0.1, 0.9)
        extra = draw(st.integers(0, 2))
        if extra:
            opts["candidate_group_size"] = grpo_size + extra
            opts["candidate_selection_min_size"] = grpo_size + draw(st.integers(0, extra))
            opts["candidate_selector"] = MCAdvantageSelector(draw(st.sampled_from(["first", "uniform", "balanced"])))
    cap = opts.get("candidate_group_size", grpo_size)
    n_groups = draw(st.integers(1, 4))
    stream = []
    uid = 0
    for g in range(n_groups):
        for _ in range(draw(st.integers(1, 2 * cap + 1))):  # >cap: the group id comes back after a decision
            steps = draw(st.integers(1, 3)) if mode is None else draw(st.integers(1, 2))
            stream.append((uid, g, [draw(REWARD) for _ in range(steps)]))
            uid += 1
    order = draw(st.permutations(range(len(stream))))
    return opts, [stream[i] for i in order]


def _stock_run(opts, stream):
    ref = MCAdvantage(prompt_key="group_id", **opts)
    outs = [groups_of(ref.inv(traj(u, g, r))) for u, g, r in stream]
    return outs, ref.get_stats()


def _assert_stats_equal(ours: dict, stock: dict) -> None:
    assert set(ours) == set(stock)
    for k, v in stock.items():
        assert ours[k] == pytest.approx(v, rel=1e-9, abs=1e-9), k


@pytest.mark.timeout(120)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(scenarios())
def test_in_process_matches_torchrl(grouping_manager, scenario):
    opts, stream = scenario
    ours = SharedMCAdvantage(prompt_key="group_id", manager=grouping_manager, required_keys=MINIMAL_KEYS, shards=3,
                             **opts)
    assert_matches_stock(ours, opts, stream)


def assert_matches_stock(ours: SharedMCAdvantage, opts: dict, stream) -> None:
    """Feed ``stream`` to ``ours`` and to a stock ``MCAdvantage``: same groups out, same counters (also used
    against the registry sharded over Ray actors, tests/ray)."""
    got = [groups_of(ours.inv(traj(u, g, r))) for u, g, r in stream]
    want, stock_stats = _stock_run(opts, stream)
    assert got == want
    _assert_stats_equal(ours.get_stats(), stock_stats)
    # nothing left staged but what is still queued
    assert len(ours.staging.handles()) == ours.get_stats()["queued_trajectories"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sum", None])
def test_two_spawn_writers_match_torchrl(grouping_manager, tmp_path, mode):
    """W=2 spawn writers, a torchrl LazyMemmapStorage allocated in the parent; groups are decided when full
    (no oversampling), so the written set does not depend on the cross-writer arrival order."""
    g = torch.Generator().manual_seed(7)
    grpo_size, n_groups = 4, 12
    stream = [(g_ * grpo_size + m, g_, torch.randint(0, 2, (1 if mode else 2,), generator=g).float().tolist())
              for g_ in range(n_groups) for m in range(grpo_size)]
    perm = torch.randperm(len(stream), generator=g).tolist()
    stream = [stream[i] for i in perm]
    storage = LazyMemmapStorage(1000, scratch_dir=tmp_path / "mm")
    buffer = make_replay_buffer(storage, grpo_size=grpo_size, manager=grouping_manager,
                                staging_dir=tmp_path / "staging", trajectory_return=mode,
                                required_keys=MINIMAL_KEYS)
    example = traj(0, 0, [0.0] * (1 if mode else 2))
    example.set("advantage", torch.zeros_like(example.get(("next", "reward"))))
    allocate_storage(storage, example)
    ctx = multiprocess.get_context("spawn")
    procs = [ctx.Process(target=writer_main, args=(buffer, stream[w::2]), daemon=True) for w in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join()  # bounded by the test's timeout only: spawned interpreters start slowly on a loaded machine
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    stats = buffer.grouping_transform.get_stats()
    rows = storage[: len(storage)]
    want, stock_stats = _stock_run(dict(grpo_size=grpo_size, trajectory_return=mode), stream)
    assert len(storage) == sum(len(r) for *_, r in stream)  # the parent sees every row the children wrote
    assert sorted(groups_of(rows)) == sorted(x for out in want for x in out)
    _assert_stats_equal(stats, stock_stats)


@pytest.mark.timeout(120)
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(scenarios(), st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_batched_handover_matches_torchrl(grouping_manager, scenario, chunk_sizes):
    """A collector hands a whole work unit over in one call (``append_many``): the decisions are exactly those
    of the same trajectories handed over one by one, in order."""
    opts, stream = scenario
    ours = SharedMCAdvantage(prompt_key="group_id", manager=grouping_manager, required_keys=MINIMAL_KEYS, shards=3,
                             **opts)
    got, pos, turn = [], 0, 0
    while pos < len(stream):
        size = chunk_sizes[turn % len(chunk_sizes)]
        chunk = [traj(u, g, r) for u, g, r in stream[pos:pos + size]]
        pos, turn = pos + size, turn + 1
        for claim in ours.process(chunk):
            got.append(groups_of(ours.group_of(claim)))
            ours.confirm(claim)
    want, stock_stats = _stock_run(opts, stream)
    assert got == [[group] for out in want for group in out]
    _assert_stats_equal(ours.get_stats(), stock_stats)
    assert len(ours.staging.handles()) == ours.get_stats()["queued_trajectories"]
