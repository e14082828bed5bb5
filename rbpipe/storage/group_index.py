"""Row positions of the live groups, kept incrementally as commit-log records arrive.

A store can hold hundreds of thousands of groups; rebuilding the row index from every group record on each
commit made writes O(groups). Here a commit appends to growable arrays, an eviction moves a lower bound,
and only a ``move`` record (compaction, rare) rebuilds the block columns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import numpy as np


class View(NamedTuple):
    """The live groups' row positions at one moment (immutable): what a read of drawn row numbers uses, so
    that later evictions, which renumber the rows, never change which groups those numbers name."""

    seqs: np.ndarray
    starts: np.ndarray
    stops: np.ndarray
    blocks: np.ndarray
    local: np.ndarray
    rows: int
    one: tuple[int, int] | None  # ``GroupIndex.one_block`` at that moment

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.seqs, self.starts, self.stops, self.blocks, self.local

    def same_numbering(self, other: View) -> bool:
        """Whether ``other`` names the same groups by the same row numbers (a compaction moved their files and
        evicted nothing): rows drawn from one read the same groups under the other."""
        return (self.rows == other.rows and np.array_equal(self.seqs, other.seqs)
                and np.array_equal(self.starts, other.starts))


class GroupIndex:
    """Growable columns over committed groups in commit order: seq, rows, cumulative rows, block, local row.

    Positions are relative to the oldest live group: ``starts``/``stops`` shift down when groups are
    evicted, while sequence numbers never change.
    """

    _FIELDS = ("seq", "n", "end", "block", "local")

    def __init__(self) -> None:
        self._cols = {f: np.zeros(1024, np.int64) for f in self._FIELDS}
        self._k = 0  # groups ever appended
        self._lo = 0  # first live group
        self.rows = 0  # live rows
        self._cache: tuple[np.ndarray, ...] | None = None
        self._one: tuple[int, int] | Literal[False] | None = None
        self._view: View | None = None

    def append(self, seq: int, n: int, block: int, local: int) -> None:
        if self._k == len(self._cols["seq"]):
            self._cols = {f: np.concatenate([a, np.zeros_like(a)]) for f, a in self._cols.items()}
        end = (self._cols["end"][self._k - 1] if self._k else 0) + n
        for f, v in zip(self._FIELDS, (seq, n, end, block, local), strict=True):
            self._cols[f][self._k] = v
        self._k += 1
        self.rows += n
        self._cache = None

    def evict_upto(self, seq: int) -> None:
        """Drop live groups with sequence number <= ``seq``."""
        live = self._cols["seq"][self._lo:self._k]
        lo = self._lo + int(np.searchsorted(live, seq, side="right"))
        if lo != self._lo:
            self._lo = lo
            self.rows = self._live_rows()
            self._cache = None

    def relocate(self, block_and_local: Callable[[int], tuple[int, int]]) -> None:
        """Recompute block/local row of every live group (after a ``move`` record)."""
        for i in range(self._lo, self._k):
            self._cols["block"][i], self._cols["local"][i] = block_and_local(int(self._cols["seq"][i]))
        self._cache = None

    def _base(self) -> int:
        """Cumulative rows of the evicted groups (row positions are relative to the first live group)."""
        return int(self._cols["end"][self._lo - 1]) if self._lo else 0

    def _live_rows(self) -> int:
        if self._lo == self._k:
            return 0
        base = self._base()
        return int(self._cols["end"][self._k - 1] - base)

    def start_of(self, seq: int) -> int | None:
        """Current first row of group ``seq`` (None if it is not live)."""
        seqs = self._cols["seq"][self._lo:self._k]
        i = int(np.searchsorted(seqs, seq))
        if i == len(seqs) or seqs[i] != seq:
            return None
        base = self._base()
        j = self._lo + i
        return int(self._cols["end"][j] - self._cols["n"][j] - base)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """(seqs, starts, stops, blocks, local rows) of the live groups, oldest first."""
        if self._cache is None:
            self._one = self._view = None
            s = slice(self._lo, self._k)
            base = self._base()
            stops = self._cols["end"][s] - base
            self._cache = (self._cols["seq"][s].copy(), stops - self._cols["n"][s], stops,
                           self._cols["block"][s].copy(), self._cols["local"][s].copy())
        return self._cache

    def one_block(self) -> tuple[int, int] | None:
        """``(block, offset)`` when every live row ``r`` sits at local row ``r + offset`` of one block (a
        compacted store), else None: sampling then skips the per-row block lookup."""
        _, starts, _, blocks, local = self.arrays()  # (re)computed after any change, which resets _one
        if self._one is None:
            single = len(blocks) > 0 and (blocks == blocks[0]).all() and (local - starts == local[0]).all()
            self._one = (int(blocks[0]), int(local[0])) if single else False
        return self._one or None

    def view(self) -> View:
        """The current positions as an immutable :class:`View` (the same object until the next change)."""
        seqs, starts, stops, blocks, local = self.arrays()  # (re)computed after any change, which resets _view
        if self._view is None:
            self._view = View(seqs, starts, stops, blocks, local, self.rows, self.one_block())
        return self._view

    def __len__(self) -> int:
        return self._k - self._lo
