"""A custom ``candidate_selector`` is user code run inside the grouping manager. Whatever it raises, even
``SystemExit`` or ``KeyboardInterrupt`` (which end a manager connection thread when they escape it), its group is
dropped with reason ``selector_error`` and the writer's connection to the manager stays up (issue 33)."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torchrl.objectives.llm import MCAdvantageSelector

from rbpipe.grouping import SharedMCAdvantage

SELECT = {"trajectory_return": "sum", "candidate_group_size": 3, "candidate_selection_min_size": 3}


class Exits(MCAdvantageSelector):
    """A selector whose ``select`` (or ``_accepted``, which torchrl asks about rescues) raises ``what``."""

    def __init__(self, what: str, where: str = "select") -> None:
        super().__init__()
        self.what, self.where = what, where

    def _raise(self):
        raise {"SystemExit": SystemExit(3), "KeyboardInterrupt": KeyboardInterrupt()}[self.what]

    def select(self, candidates, *, group_size, keep_return_bounds=None):
        if self.where == "select":
            self._raise()
        return super().select(candidates, group_size=group_size, keep_return_bounds=keep_return_bounds)

    def _accepted(self, *args):
        if self.where == "_accepted":
            self._raise()
        return super()._accepted(*args)


def scored(group: str, reward: float) -> TensorDict:
    td = TensorDict({("next", "reward"): torch.tensor([[reward]]), ("next", "done"): torch.tensor([[True]])},
                    batch_size=[1])
    td.set_non_tensor("query", group)
    return td


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what,where", [("SystemExit", "select"), ("KeyboardInterrupt", "select"),
                                        ("SystemExit", "_accepted")])
def test_a_selector_that_exits_drops_its_group_and_the_connection_lives(grouping_manager, what, where):
    t = SharedMCAdvantage(2, manager=grouping_manager, candidate_selector=Exits(what, where), **SELECT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the same group again: the next writer adding to it must not be cut off either
            for reward in (0.0, 1.0, 0.5):
                assert t.inv(scored("q", reward)) is None
    messages = [str(w.message) for w in caught]
    assert sum("candidate_selector raised" in m and what in m for m in messages) == 2, messages
    stats = t.get_stats()  # the connection still answers
    assert (stats["dropped_groups"], stats["written_groups"], stats["queued_trajectories"]) == (2, 0, 0)
    assert t.drop_reasons()["selector_error"] == 2
    assert t.staging.handles() == []
    t.shutdown()
