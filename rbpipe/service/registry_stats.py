"""``CachedStats``: what the coordinator reads of the registry's counters, at most every ``ttl_s``.

Why a cache: the coordinator reads the dropped groups on every change (they move the rate-limit band), and a
registry's counters cost a pass over all of its shards (a Ray call to each, for Ray's registry).
"""

from __future__ import annotations

import time
from typing import Any


class CachedStats:
    """The registry's ``get_stats()``, reused for ``ttl_s`` unless asked ``fresh``.

    Examples:
        >>> class Registry:
        ...     calls = 0
        ...     def get_stats(self, fresh=False):
        ...         Registry.calls += 1
        ...         return {"dropped_groups": Registry.calls}
        >>> stats = CachedStats(Registry(), ttl_s=60.0)
        >>> stats.get_stats(), stats.get_stats(), stats.get_stats(fresh=True)
        ({'dropped_groups': 1}, {'dropped_groups': 1}, {'dropped_groups': 2})
    """

    def __init__(self, registry, ttl_s: float) -> None:
        self.registry, self.ttl_s, self._at = registry, float(ttl_s), -1e9
        self._stats: dict[str, Any] = {}

    def get_stats(self, fresh: bool = False) -> dict:
        now = time.monotonic()
        if fresh or now - self._at > self.ttl_s:
            self._stats, self._at = self.registry.get_stats(fresh=fresh), now
        return self._stats
