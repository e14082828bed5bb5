"""Claims: a completed group that one writer process must write, then confirm, and the warning it gets when the
group was taken over meanwhile.

Examples:
    >>> claim = Claim("c1", "prompt-7", selected=["h1", "h2"], advantages=[], unselected=["h3"])
    >>> claim.handles
    ['h1', 'h2', 'h3']
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from tensordict import TensorDictBase

from rbpipe.grouping.leases import TTL_ENV


class ClaimLostWarning(RuntimeWarning):
    """A claim this process held was taken over by another writer: its lease expired (it did not renew it for
    the lease's time to live: frozen, stalled, suspended) before the group was confirmed."""


def warn_lost(group, what: str) -> None:
    warnings.warn(f"group {group!r} is no longer this process's to write ({what}): its lease expired (no heartbeat "
                  f"for the lease's time to live, e.g. the process was frozen or stalled) and another writer took "
                  f"the group over, which writes and confirms it. Nothing to do here; if this repeats, raise "
                  f"{TTL_ENV} or find what stalls this process", ClaimLostWarning, stacklevel=4)


@dataclass
class Claim:
    """A completed group this process must write, then confirm."""

    commit_id: str
    group: Any
    selected: list[str]
    advantages: list[tuple]
    unselected: list[str]
    rows: int | None = None
    _members: list[TensorDictBase] | None = field(default=None, repr=False)
    #: the selected members already concatenated (``load``'s fast path for same-layout tensor trajectories)
    assembled: TensorDictBase | None = field(default=None, repr=False)
    _sizes: list[int] | None = field(default=None, repr=False)
    #: one-step members of varying lengths as one TensorDict of ``[n, j]`` jagged leaves, for rbpipe stores
    jagged: TensorDictBase | None = field(default=None, repr=False)
    _build_members: Any = field(default=None, repr=False)
    #: taken over from a writer that died (or, with ``recover(force=True)``, from another writer)
    recovered: bool = False
    #: why writing it failed (set by the writer that quarantined it)
    error: BaseException | None = field(default=None, repr=False)
    #: the lease token it was handed to: only that owner may confirm or quarantine it (None: anyone may)
    owner: str | None = field(default=None, repr=False)

    @property
    def members(self) -> list[TensorDictBase]:
        """The selected trajectories, advantages set (built by ``load``, or on first use)."""
        if self._members is None:
            if self._build_members is not None:
                self._members = self._build_members()
            else:
                self._members = [] if self.assembled is None else list(self.assembled.split(self._sizes))
        return self._members

    @property
    def handles(self) -> list[str]:
        return self.selected + self.unselected
