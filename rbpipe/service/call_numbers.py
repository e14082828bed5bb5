"""``CallNumbers``: a collector's take or count that the service runs twice acts once.

The Ray engine restarts its coordinator actor with ``max_task_retries=-1``: a call that the coordinator's death
cut off runs again on the new process. When the dead coordinator had already run and journaled that call (the
window is one journal write), running it again would act twice: a take would hand out a second share of units
(the first share stays with that collector's lease, never generated, and its prompts are never completed while
the collector lives), a count would count its trajectories twice (the summary's conservation would no longer
balance). So a collector numbers its takes and counts (one counter per client), and the coordinator keeps, per
lease, its last numbered take with the answer and its last count's number. They are saved in the coordinator's
journal line of that very call (``prompts.json``'s ``live`` entry), so a restarted coordinator has them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class CallNumbers:
    """Each lease's last numbered take (with its answer) and last numbered count.

    Args:
        saved: what :meth:`saved` returned, read back from the journal (a restarted coordinator); None to start.

    Examples:
        >>> calls = CallNumbers()
        >>> calls.took("lease-a", 1, [{"prompt": 0, "samples": 2}])
        >>> calls.take_again("lease-a", 1, holds=lambda unit: True)  # the same take again: the same answer
        [{'prompt': 0, 'samples': 2}]
        >>> calls.take_again("lease-a", 2, holds=lambda unit: True) is None  # a new take
        True
        >>> calls.first_count("lease-a", 3), calls.first_count("lease-a", 3)
        (True, False)
    """

    def __init__(self, saved: dict | None = None) -> None:
        saved = saved or {}
        self._takes: dict[str, tuple[int, list[dict]]] = {
            str(lease): (int(ask), [dict(unit) for unit in units])
            for lease, (ask, units) in saved.get("answers", {}).items()}
        self._counts: dict[str, int] = {str(lease): int(ask) for lease, ask in saved.get("counted", {}).items()}

    def take_again(self, lease: str, ask: int | None, holds: Callable[[dict], bool]) -> list[dict] | None:
        """The units ``lease``'s take number ``ask`` was given, if that was its last take and it still
        ``holds`` each of them (none handed over since); None: a take to run."""
        if ask is None or lease not in self._takes:
            return None
        last, units = self._takes[lease]
        if last != int(ask) or not all(holds(unit) for unit in units):
            return None
        return [dict(unit) for unit in units]

    def took(self, lease: str, ask: int | None, units: list[dict]) -> None:
        """``lease``'s take number ``ask`` was given ``units`` (unnumbered takes are not remembered)."""
        if ask is not None:
            self._takes[lease] = (int(ask), [dict(unit) for unit in units])

    def first_count(self, lease: str | None, ask: int | None) -> bool:
        """Whether to count this call: False for a number ``lease`` already counted (unnumbered: always)."""
        if lease is None or ask is None:
            return True
        if int(ask) <= self._counts.get(lease, 0):
            return False
        self._counts[lease] = int(ask)
        return True

    def forget(self, lease: str) -> None:
        """The lease ended: its calls can no longer come again."""
        self._takes.pop(lease, None)
        self._counts.pop(lease, None)

    def saved(self, leases: Iterable[str]) -> dict:
        """Plain JSON of the numbers of ``leases`` (the collectors still joined), for the journal."""
        keep = set(leases)
        return {"answers": {lease: [ask, units] for lease, (ask, units) in self._takes.items() if lease in keep},
                "counted": {lease: ask for lease, ask in self._counts.items() if lease in keep}}
