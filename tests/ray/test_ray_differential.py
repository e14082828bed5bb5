"""The grouping registry sharded over 2 Ray actors decides exactly like torchrl's stock ``MCAdvantage``
(the differential test of ``tests/grouping/test_differential.py``, run against ``ShardedRegistry``)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from rbpipe.grouping import SharedMCAdvantage
from rbpipe.service.ray import RayManager, shard_of
from tests.grouping.helpers import MINIMAL_KEYS
from tests.grouping.test_differential import assert_matches_stock, scenarios


@pytest.fixture(scope="module")
def sharded_manager(ray_cluster):
    manager = RayManager.start(shards=2)
    yield manager
    manager.shutdown()


@pytest.mark.timeout(240)
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(scenarios())
def test_sharded_registry_matches_torchrl(sharded_manager, scenario):
    opts, stream = scenario
    ours = SharedMCAdvantage(prompt_key="group_id", manager=sharded_manager, required_keys=MINIMAL_KEYS, **opts)
    try:
        assert_matches_stock(ours, opts, stream)
    finally:
        ours.close()


def test_shard_of_is_stable_and_spreads():
    assert [shard_of(g, 2) for g in range(8)] == [shard_of(g, 2) for g in range(8)]
    assert shard_of(5, 2) == shard_of("5", 2) == shard_of(5.0, 2)  # one key, one shard, whatever its type
    for k in (2, 4):
        assert len({shard_of(g, k) for g in range(64)}) == k
    assert all(shard_of(g, 1) == 0 for g in range(10))
