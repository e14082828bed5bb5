"""``GroupStore``: what the replay buffer and ``GroupWriter`` need from a store, declared once.

The buffer used to guess a store's abilities at run time (``hasattr(storage, "append_group")``, and
``inspect.signature`` to see whether ``append_group`` takes a ``commit_id``). The answers are now stated
by the store, as class attributes, and checked in one place (:func:`is_group_store`):

* ``append_group(td, *, commit_id=None, member_ids=None)``: commit one whole group atomically (``td`` of
  batch size ``[n]``) and return its row indices; with ``commit_id`` the commit is idempotent (a recovery
  writing a group a dead writer already committed adds nothing), and ``member_ids`` (e.g. staging handles)
  are recorded with it.
* ``committed_member_ids()``: every member id ever committed, for a recovering writer.
* ``accepts_jagged``: ``td`` may hold members of varying lengths as one TensorDict of ``[n, j]`` jagged
  leaves (``rbpipe.members``), which such a store writes as cheaply as dense ones.
* ``idempotent_commits``: ``append_group`` honours ``commit_id``/``member_ids``.
* ``holds_reads``: ``hold(index, group_seqs=...)`` keeps what a later ``get(index)`` reads open, under the
  numbering ``index`` was drawn from, so that that read returns exactly the drawn groups whatever is evicted
  or renumbered meanwhile (raising :class:`~rbpipe.errors.StaleReadError` when they are gone already, or
  when ``index`` no longer names the groups ``group_seqs``): a sampler draws again instead of handing out
  rows that would read other groups.
* ``group_minimums(key, seqs)``: each group's smallest value of a one-element integer column (the policy
  version), from what the store already knows of it (its commit record), for the groups it can answer
  without reading data; the sampler reads the column for the others.

Any torchrl ``Storage`` that is not a ``GroupStore`` is written row range by row range (the grouping
reserves the rows). ``GroupStorage`` (Arrow, Zarr) implements the protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class GroupStore(Protocol):
    """A store that commits whole groups (see the module doc)."""

    accepts_jagged: bool
    idempotent_commits: bool
    holds_reads: bool

    def append_group(self, td: Any, *, commit_id: str | None = None,
                     member_ids: list[str] | None = None) -> torch.Tensor: ...

    def committed_member_ids(self) -> set[str]: ...

    def hold(self, index: torch.Tensor, *, group_seqs: Sequence[int] | None = None) -> None: ...

    def group_minimums(self, key: Any, seqs: Sequence[int]) -> dict[int, int]: ...


_BY_CLASS: dict[type, bool] = {}


def is_group_store(storage: Any) -> bool:
    """Whether ``storage`` declares itself a :class:`GroupStore` (its class states the capability flags).

    Answered once per class: ``isinstance`` against a runtime-checkable protocol looks up every member each
    time, and the buffer asks on every hand-over (a third of a writer's time per hand-over; docs/DESIGN.md,
    Figures behind code choices)."""
    cls = type(storage)
    known = _BY_CLASS.get(cls)
    if known is None:
        known = _BY_CLASS[cls] = isinstance(storage, GroupStore)
    return known
