"""``Coordinator``: the service's share-out of prompts to collectors that come and go, and its run counters.

It lives in the grouping manager process beside the registry. A collector asks for a *work unit* (a prompt
index and how many of that prompt's samples to generate) under its lease; the registry tells the coordinator
every trajectory appended under a lease, so a unit is done exactly when its samples were handed over. A
collector that leaves (lease released) or dies (lease expired) loses only what it had not handed over: the
rest of its units goes back to the pool and the next collector that asks completes those prompts first.

Units of one prompt are given to different collectors where possible (groups mix policies' samples the way
the single-launcher run always did); a collector alone gets a whole prompt. New prompts open only while the
rate limiter's band allows (collectors' lead over the learner, :mod:`rbpipe.rate_limit`).

The learner reports its progress here (step, groups trained / retired, phase, done), which moves the band
on and is what ``rbpipe serve`` and ``rbpipe run`` show and summarise. The prompt share-out is persisted on
every change (``prompts.json``, written atomically), so a resumed service continues the same prompts.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from rbpipe.grouping.leases import LEASES
from rbpipe.rate_limit import RateLimiter

PROMPTS = "prompts.json"
#: learner fields a learner may report (all ints but ``phase``/``busy``): unknown names are refused
LEARNER_FIELDS = ("step", "done", "phase", "consumed_groups", "stale_groups", "stale_trajectories",
                  "sample_blocked_ns")


class Coordinator:
    """Work units, run counters and learner progress of one service (manager-side; see the module docstring).

    Args:
        samples_per_prompt: samples generated per prompt (``grpo_size``, or the candidate group size).
        unit_size: samples per work unit (the last unit of a prompt may be smaller).
        limiter: settings of the band (``RateLimiter`` keyword arguments, ``writers`` is 1: this object).
        state_dir: where ``prompts.json`` and the band's file live (the run directory).
        registry: the registry whose dropped groups also move the band on.
    """

    exposed = ("take", "skip", "count", "release", "report_learner", "learner", "status", "endpoint",
               "set_endpoint", "request_stop", "stop_requested")

    def __init__(self, samples_per_prompt: int, unit_size: int, limiter: dict, state_dir: str,
                 registry=None) -> None:
        self.samples_per_prompt = int(samples_per_prompt)
        self.unit_size = max(1, min(int(unit_size), self.samples_per_prompt))
        self._state_path = Path(state_dir) / PROMPTS
        self._registry = registry
        self._lock = threading.Lock()
        self._limiter = RateLimiter(**limiter, writers=1, path=Path(state_dir) / "rate_limit.bin", create=True)
        self.next_prompt = 0
        self._pool: dict[int, int] = {}  # open prompt -> samples nobody generates yet (insertion = age order)
        self._units: dict[tuple[int, str], int] = {}  # (prompt, lease) -> samples still to hand over
        self._holders: set[str] = set()  # leases that took a unit and have not left
        self._released: set[str] = set()
        self._counts = {"produced": 0, "rejected": 0, "units": 0, "reissued_samples": 0, "lost_leases": 0,
                        "insert_blocked_ns": 0}
        self._blocked_since: dict[str, int] = {}
        self._learner: dict[str, Any] = {name: 0 for name in LEARNER_FIELDS}
        self._endpoint: dict = {}
        self._stop = False
        self._load()

    # -- persistence -------------------------------------------------------------------------------------------
    def _load(self) -> None:
        """A resumed service: the prompts still owed (units of workers of the last session return to the pool)."""
        try:
            state = json.loads(self._state_path.read_text())
        except (OSError, ValueError):
            return
        self.next_prompt = int(state.get("next_prompt", 0))
        self._pool = {int(p): int(n) for p, n in state.get("todo", {}).items() if int(n) > 0}
        self._limiter.set_inserted(0, self.next_prompt)

    def _save(self) -> None:
        todo = dict(self._pool)
        for (prompt, _), left in self._units.items():
            todo[prompt] = todo.get(prompt, 0) + left
        tmp = self._state_path.with_name(PROMPTS + ".tmp")
        tmp.write_text(json.dumps({"next_prompt": self.next_prompt, "todo": {str(p): n for p, n in todo.items()}}))
        os.replace(tmp, self._state_path)

    # -- work units --------------------------------------------------------------------------------------------
    def take(self, lease: str) -> dict | None:
        """The next unit for the collector holding ``lease``: ``{"prompt", "samples"}``, or None while the band
        is full (ask again shortly). A dead or unknown lease gets nothing (``{"lease": "expired"}``)."""
        if not LEASES.alive(lease):
            return {"lease": "expired"}
        with self._lock:
            self._reclaim()
            self._holders.add(lease)
            unit = self._pick(lease)
            now = time.monotonic_ns()
            if unit is None:
                self._blocked_since.setdefault(lease, now)
                return None
            since = self._blocked_since.pop(lease, None)
            if since is not None:
                self._counts["insert_blocked_ns"] += now - since
            prompt, n = unit
            self._units[(prompt, lease)] = self._units.get((prompt, lease), 0) + n
            self._counts["units"] += 1
            self._save()
            return {"prompt": prompt, "samples": n}

    def _pick(self, lease: str) -> tuple[int, int] | None:
        open_ = [p for p, n in self._pool.items() if n > 0]
        for prompt in open_:  # oldest first: a prompt this collector has no share of yet
            if (prompt, lease) not in self._units:
                return prompt, self._from_pool(prompt)
        can_open = self._band_allows()
        if open_ and (len(self._live_holders()) <= 1 or not can_open):
            return open_[0], self._from_pool(open_[0])  # alone, or the band is full: finish the oldest
        if not can_open:
            return None
        prompt = self.next_prompt
        self.next_prompt += 1
        self._limiter.set_inserted(0, self.next_prompt)
        self._pool[prompt] = self.samples_per_prompt
        return prompt, self._from_pool(prompt)

    def _from_pool(self, prompt: int) -> int:
        n = min(self.unit_size, self._pool[prompt])
        self._pool[prompt] -= n
        if not self._pool[prompt]:
            del self._pool[prompt]
        return n

    def _band_allows(self) -> bool:
        if self._registry is not None:
            self._limiter.set_samples(1, int(self._registry.get_stats().get("dropped_groups", 0)))
        return self._limiter.can_insert(1, 0)

    def _live_holders(self) -> list[str]:
        return [h for h in self._holders if LEASES.alive(h)]

    def _reclaim(self) -> None:
        """Units of leases that ended go back to the pool (oldest prompts stay first in line)."""
        dead = {h for h in self._holders if not LEASES.alive(h)}
        if not dead:
            return
        back: dict[int, int] = {}
        for (prompt, lease), left in list(self._units.items()):
            if lease in dead:
                del self._units[(prompt, lease)]
                back[prompt] = back.get(prompt, 0) + left
        for lease in dead:
            if lease not in self._released:
                self._counts["lost_leases"] += 1
            self._released.discard(lease)
            self._blocked_since.pop(lease, None)
        self._holders -= dead
        if back:
            self._counts["reissued_samples"] += sum(back.values())
            merged = {p: n + back.pop(p, 0) for p, n in self._pool.items()}
            self._pool = dict(sorted({**merged, **back}.items()))
        self._save()

    def appended(self, group, lease) -> None:
        """(Registry hook, manager-side.) One trajectory of prompt ``group`` was appended under ``lease``."""
        key = (group, lease)
        with self._lock:
            left = self._units.get(key)
            if left is None:
                return  # not a unit's sample (a user's own loop, a requeued payload)
            if left <= 1:
                del self._units[key]
            else:
                self._units[key] = left - 1
            self._save()

    def skip(self, lease: str, prompt: int, n: int = 1) -> None:
        """``n`` samples of the caller's unit that will never be handed over (rejected as bad input)."""
        for _ in range(int(n)):
            self.appended(prompt, lease)

    def release(self, lease: str) -> None:
        """A collector leaves cleanly: what it still owed goes back to the pool at once."""
        with self._lock:
            self._released.add(lease)
        LEASES.release(lease)
        with self._lock:
            self._reclaim()

    # -- counters and progress ---------------------------------------------------------------------------------
    def count(self, produced: int = 0, rejected: int = 0) -> None:
        with self._lock:
            self._counts["produced"] += int(produced)
            self._counts["rejected"] += int(rejected)

    def report_learner(self, **fields) -> None:
        unknown = set(fields) - set(LEARNER_FIELDS)
        if unknown:
            raise ValueError(f"unknown learner fields {sorted(unknown)}; known: {LEARNER_FIELDS}")
        with self._lock:
            self._learner.update(fields)
            self._limiter.set_samples(0, int(self._learner["consumed_groups"]) + int(self._learner["stale_groups"]))

    def learner(self) -> dict:
        return dict(self._learner)

    def status(self) -> dict:
        """Everything a progress line, a stall report or a summary needs, in one call."""
        with self._lock:
            self._reclaim()
            blocked = sum(time.monotonic_ns() - t for t in self._blocked_since.values())
            return {**self._counts, "insert_blocked_ns": self._counts["insert_blocked_ns"] + blocked,
                    "next_prompt": self.next_prompt, "open_prompts": len({p for p, _ in self._units} | set(self._pool)),
                    "collectors": len(self._live_holders()), "band": self._limiter.describe(),
                    "learner": dict(self._learner)}

    # -- the service's own description -------------------------------------------------------------------------
    def set_endpoint(self, endpoint: dict) -> None:
        self._endpoint = dict(endpoint)

    def endpoint(self) -> dict:
        """What a worker attaching by ``HOST:PORT`` needs (the same as ``endpoint.json``, key aside)."""
        return dict(self._endpoint)

    def request_stop(self) -> None:
        """Ask every attached worker to finish (``rbpipe serve`` stopping; the learner reached its steps)."""
        self._stop = True

    def stop_requested(self) -> bool:
        return self._stop

    def close(self) -> None:
        self._limiter.unlink()


_COORDINATORS: dict[str, Coordinator] = {}
_COORDINATORS_LOCK = threading.Lock()


def get_coordinator(name: str, settings: dict | None = None) -> Coordinator:
    """Manager-side factory: the coordinator of registry ``name`` (created with ``settings`` on first use),
    which the registry then tells about every append."""
    from rbpipe.grouping.registry import get_registry

    with _COORDINATORS_LOCK:
        coord = _COORDINATORS.get(name)
        if coord is None:
            if settings is None:
                raise KeyError(f"no coordinator named {name!r} in this service")
            registry = get_registry(name)
            coord = _COORDINATORS[name] = Coordinator(**settings, registry=registry)
            registry.on_append = coord.appended
        return coord
