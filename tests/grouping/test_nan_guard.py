"""Finite rewards can still give non-finite advantages (a return that overflows float32, a one-member
per-step group whose std is NaN): such a group is dropped with a counted reason, never written with NaNs."""

from __future__ import annotations

import pytest

from rbpipe.grouping import SharedMCAdvantage
from tests.grouping.helpers import MINIMAL_KEYS, traj


def _transform(manager, grpo_size: int, **opts) -> SharedMCAdvantage:
    return SharedMCAdvantage(grpo_size, prompt_key="group_id", manager=manager, required_keys=MINIMAL_KEYS, **opts)


def _assert_dropped_as_nonfinite(t: SharedMCAdvantage, outs: list) -> None:
    assert all(out is None for out in outs), "a group with non-finite advantages was written"
    stats = t.get_stats()
    assert stats["dropped_groups"] == 1 and stats["written_groups"] == 0
    assert stats["selected_trajectories"] == 0 and stats["rescued_groups"] == 0  # nothing of it was selected
    assert stats["queued_trajectories"] == 0
    assert t.drop_reasons()["nonfinite_advantage"] == 1
    assert t.staging.handles() == []


@pytest.mark.timeout(60)
def test_returns_that_overflow_float32_drop_the_group(grouping_manager):
    t = _transform(grouping_manager, 2, trajectory_return="sum")
    with pytest.warns(RuntimeWarning, match="not finite"):
        outs = [t.inv(traj(0, 5, [3e38, 3e38])), t.inv(traj(1, 5, [0.0]))]  # 3e38 + 3e38 = inf in float32
    _assert_dropped_as_nonfinite(t, outs)


@pytest.mark.timeout(60)
def test_a_group_mean_that_overflows_drops_the_group(grouping_manager):
    t = _transform(grouping_manager, 2, trajectory_return="mean")
    with pytest.warns(RuntimeWarning, match="not finite"):
        outs = [t.inv(traj(0, 6, [3e38])), t.inv(traj(1, 6, [3e38]))]  # each return finite, the mean is not
    _assert_dropped_as_nonfinite(t, outs)


@pytest.mark.timeout(60)
def test_a_single_member_per_step_group_drops_instead_of_nan(grouping_manager):
    t = _transform(grouping_manager, 1)
    with pytest.warns(RuntimeWarning, match="not finite"):
        outs = [t.inv(traj(0, 7, [1.0]))]  # std of one value is NaN
    _assert_dropped_as_nonfinite(t, outs)
    assert t.inv(traj(1, 8, [1.0, 0.0])) is not None  # two steps: a finite std, written as torchrl would


@pytest.mark.timeout(60)
def test_a_dropped_candidate_group_keeps_only_its_unselected_count(grouping_manager):
    t = _transform(grouping_manager, 2, trajectory_return="sum", candidate_group_size=3,
                   candidate_selection_min_size=3)
    with pytest.warns(RuntimeWarning, match="not finite"):
        outs = [t.inv(traj(0, 9, [3e38, 3e38])), t.inv(traj(1, 9, [0.0])), t.inv(traj(2, 9, [1.0]))]
    _assert_dropped_as_nonfinite(t, outs)
    assert t.get_stats()["unselected_trajectories"] == 1  # the candidate the selection left out
