"""Counters shared by the run's processes: a memory-mapped int64 array, one writer per slot.

Each slot has exactly one writing process, so no lock is needed and a SIGKILLed worker cannot leave
one held; the launcher reads everything for the progress bar and the summary.
"""

from __future__ import annotations

from pathlib import Path

import torch

CONSUMED_GROUPS, LEARNER_STEP, LEARNER_DONE, STALE_TRAJECTORIES = 0, 1, 2, 3
# prompts the pipeline is done with although the learner never trained on them: retired as stale by the
# learner's sampler (learner-written) and dropped by dynamic sampling (launcher-written, from the grouping stats)
STALE_GROUPS, DROPPED_GROUPS = 4, 5
# the learner's start-up phase (rbpipe.progress.LEARNER_*), read by the launcher's progress line
LEARNER_PHASE = 6
_FIXED = 8


class RunCounters:
    def __init__(self, path: str | Path, collectors: int, *, create: bool = False) -> None:
        self.path, self.collectors = Path(path), int(collectors)
        if create:
            self.path.unlink(missing_ok=True)
        self._open()

    def _open(self) -> None:
        self._a = torch.from_file(str(self.path), shared=True, size=_FIXED + 3 * self.collectors,
                                  dtype=torch.int64)

    def __getstate__(self) -> dict:
        return {"path": str(self.path), "collectors": self.collectors}

    def __setstate__(self, state: dict) -> None:
        self.path, self.collectors = Path(state["path"]), state["collectors"]
        self._open()

    def get(self, slot: int) -> int:
        return int(self._a[slot])

    def set(self, slot: int, value: int) -> None:
        self._a[slot] = int(value)

    # per-collector slots: produced, rejected, next prompt index
    def _slot(self, kind: int, cid: int) -> int:
        return _FIXED + kind * self.collectors + cid

    def add_produced(self, cid: int, n: int = 1) -> None:
        self._a[self._slot(0, cid)] += n

    def add_rejected(self, cid: int, n: int = 1) -> None:
        self._a[self._slot(1, cid)] += n

    def set_prompt_cursor(self, cid: int, index: int) -> None:
        self._a[self._slot(2, cid)] = index

    def prompt_cursor(self, cid: int) -> int:
        return int(self._a[self._slot(2, cid)])

    def produced(self) -> int:
        return int(self._a[_FIXED:_FIXED + self.collectors].sum())

    def rejected(self) -> int:
        return int(self._a[_FIXED + self.collectors:_FIXED + 2 * self.collectors].sum())

    def resolved_groups(self) -> int:
        """Prompts that left the pipeline: trained on, retired as stale, or dropped: the rate limiter's
        samples (:mod:`rbpipe.rate_limit`). Counting trained groups alone would let every stale or dropped
        group shrink the allowed lead for good, and enough of them would stall collectors and learner together."""
        return self.get(CONSUMED_GROUPS) + self.get(STALE_GROUPS) + self.get(DROPPED_GROUPS)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)
