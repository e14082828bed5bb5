"""Joining a registry by name: options, staging and names that do not match fail at construction, in words."""

from __future__ import annotations

import pytest

from rbpipe.errors import ConfigError
from rbpipe.grouping import SharedMCAdvantage, connect_manager, manager_address
from tests.grouping.helpers import MINIMAL_KEYS


def _make(manager, grpo_size: int = 2, **kwargs) -> SharedMCAdvantage:
    return SharedMCAdvantage(grpo_size, prompt_key="group_id", manager=manager, required_keys=MINIMAL_KEYS,
                             **kwargs)


@pytest.mark.timeout(60)
def test_a_second_opener_with_other_options_is_refused(grouping_manager, tmp_path):
    first = _make(grouping_manager, 2, name="join-options", staging_dir=tmp_path)
    same = _make(grouping_manager, 2, name="join-options", staging_dir=tmp_path)  # same options: joins
    assert same.registry_name == first.registry_name
    with pytest.raises(ConfigError, match="grpo_size"):
        _make(grouping_manager, 4, name="join-options", staging_dir=tmp_path)
    with pytest.raises(ConfigError, match="trajectory_return"):
        _make(grouping_manager, 2, name="join-options", staging_dir=tmp_path, trajectory_return="sum")


@pytest.mark.timeout(60)
def test_a_shared_name_needs_the_same_staging_directory(grouping_manager, tmp_path):
    first = _make(grouping_manager, name="join-staging", staging_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="staging"):
        _make(grouping_manager, name="join-staging")  # its own temporary staging: others cannot read it
    with pytest.raises(ConfigError, match=str(first.staging.path)):
        _make(grouping_manager, name="join-staging", staging_dir=tmp_path / "b")
    assert _make(grouping_manager, name="join-staging", staging_dir=tmp_path / "a").staging.path == first.staging.path


@pytest.mark.timeout(60)
def test_a_connected_manager_needs_a_registry_name(grouping_manager, tmp_path):
    joined = connect_manager(*manager_address(grouping_manager))
    with pytest.raises(ConfigError, match="name="):
        _make(joined, staging_dir=tmp_path)
    assert _make(joined, name="join-connected", staging_dir=tmp_path).registry_name == "join-connected"
