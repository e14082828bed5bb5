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
on and is what ``rbpipe serve`` and ``rbpipe run`` show and summarise. The prompts still owed are persisted
whenever their total changes (``prompts.json`` and its journal, :mod:`rbpipe.service.journal`: one appended line per
hand-over), so a resumed service continues them, after a kill too.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from rbpipe.grouping.leases import LEASES
from rbpipe.rate_limit import RateLimiter
from rbpipe.rundir import PROMPTS, RATE_LIMIT
from rbpipe.service.api import COORDINATOR_EXPOSED
from rbpipe.service.call_numbers import CallNumbers
from rbpipe.service.journal import StateJournal
from rbpipe.service.registry_stats import CachedStats
from rbpipe.timing import MAX_TAKE_WAIT_S, STATS_CACHE_S

#: learner fields a learner may report (all ints but ``phase``/``busy``): unknown names are refused
LEARNER_FIELDS = ("step", "done", "phase", "consumed_groups", "stale_groups", "stale_trajectories",
                  "sample_blocked_ns", "start_step")  # start_step: the checkpoint step the learner started from


class Coordinator:
    """Work units, run counters and learner progress of one service (manager-side; see the module docstring).

    Args:
        samples_per_prompt: samples generated per prompt (``grpo_size``, or the candidate group size).
        unit_size: samples per work unit (the last unit of a prompt may be smaller).
        limiter: the band's settings (:meth:`RateLimiter.settings_for_run`); this object is its one writer.
        state_dir: where ``prompts.json`` and the band's file live (the run directory).
        expect_collectors: no prompt opens before this many collectors joined (``rbpipe run`` starts N at
            once: its first groups mix them too); 1 for a service whose collectors come when they like.
        registry: the registry whose dropped groups also move the band on.
        stats_cache_s: how long its counters are reused (they are read on every change; fresh at close).
        restarted: this service's coordinator again, after its process died (the Ray engine restarts its actor):
            the live service's state comes back from ``prompts.json`` whole (units still held by their
            collectors, collector ids, the learner's progress, the band's file), not as a resume would take it.
        restartable: the engine restarts this coordinator's process if it dies (Ray, with a log directory), so
            ``prompts.json`` also records every take (with its answer), join and learner report for
            ``restarted``. Otherwise it is written where a resume needs it (a new prompt opened, a hand-over and
            its count, close).

    Examples:
        >>> import tempfile
        >>> from rbpipe.grouping.leases import LEASES
        >>> coord = Coordinator(4, 2, {"samples_per_insert": 1.0, "error_buffer": 2.0, "min_size_to_sample": 1},
        ...                     tempfile.mkdtemp())
        >>> a, b = LEASES.grant(), LEASES.grant()
        >>> coord.join(a), coord.join(b)  # collector ids
        (0, 1)
        >>> coord.take(a), coord.take(b)  # two collectors share prompt 0
        ({'prompt': 0, 'samples': 2}, {'prompt': 0, 'samples': 2})
        >>> coord.close()
    """

    exposed = COORDINATOR_EXPOSED

    def __init__(self, samples_per_prompt: int, unit_size: int, limiter: dict, state_dir: str,
                 expect_collectors: int = 1, registry=None, stats_cache_s: float = STATS_CACHE_S,
                 restarted: bool = False, restartable: bool = False) -> None:
        self.samples_per_prompt = int(samples_per_prompt)
        self.unit_size = max(1, min(int(unit_size), self.samples_per_prompt))
        self._state = StateJournal(Path(state_dir) / PROMPTS)
        self._registry = None if registry is None else CachedStats(registry, stats_cache_s)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # what a waiting take_many waits for: the band moved
        # a restarted coordinator reopens the band's file: its counters are the live service's
        self._limiter = RateLimiter(**limiter, writers=1, path=Path(state_dir) / RATE_LIMIT, create=not restarted)
        self._expect = max(1, int(expect_collectors))
        self.next_prompt = 0
        self._pool: dict[int, int] = {}  # open prompt -> samples nobody generates yet (insertion = age order)
        self._units: dict[tuple[int, str], int] = {}  # (prompt, lease) -> samples still to hand over
        self._shares: dict[int, set[str]] = {}  # open prompt -> leases that took a unit of it
        self._holders: set[str] = set()  # leases that joined and have not left
        self._joined: set[str] = set()  # every lease that ever joined (the start-up gate)
        self._ids: dict[str, int] = {}  # lease -> collector id
        self._next_id = 0
        self._released: set[str] = set()
        self._learner_lease: str | None = None
        self._counts = {"produced": 0, "rejected": 0, "units": 0, "reissued_samples": 0, "lost_leases": 0,
                        "insert_blocked_ns": 0, "generate_ns": 0, "handover_ns": 0, "largest_handover": 0}
        self._totals = {"produced": 0, "rejected": 0, "dropped_groups": 0}  # earlier sessions of this run
        self._reasons: dict[str, int] = {}  # rejected samples by reason (prompt_too_long, reward_error...), run-wide
        self._blocked_since: dict[str, int] = {}
        self._calls = CallNumbers()  # a take or count that Ray runs again acts once
        self._learner: dict[str, Any] = {name: 0 for name in LEARNER_FIELDS}
        self._endpoint: dict = {}
        self._stop = False
        self._closed = False
        self._restartable = bool(restartable)
        self._load(restarted)

    # -- persistence -------------------------------------------------------------------------------------------
    def _load(self, restarted: bool = False) -> None:
        """A resumed service: the prompts still owed (units of workers of the last session return to the pool).
        A restarted one (``restarted``): the same service goes on, so the units its collectors hold stay theirs,
        and its counters are the session's (the shards, which lived on, count their dropped groups)."""
        state = self._state.load()
        if state is None:
            return
        self.next_prompt = int(state.get("next_prompt", 0))
        self._pool = {int(p): int(n) for p, n in state.get("todo", {}).items() if int(n) > 0}
        self._totals.update({k: int(v) for k, v in state.get("totals", {}).items() if k in self._totals})
        self._reasons = {str(k): int(v) for k, v in state.get("rejected_reasons", {}).items()}
        if restarted and "live" in state:
            self._restore_live(state["live"])
        self._limiter.set_inserted(0, self.next_prompt)
        self._limiter.set_samples(1, self._totals["dropped_groups"])

    def _restore_live(self, live: dict) -> None:
        """What :meth:`_share_out` saved of the live service under ``"live"``: the units each collector holds
        (taken out of the pool, which counts them as owed), collector ids, the learner. The holders' leases are
        taken in as live for one time to live (the service's lease table restarted empty): a collector that still
        lives renews it, one that died loses its units then, as it would have. The session's counters and the
        earlier sessions' totals come back apart, as they were (the summary balances the session's alone)."""
        self._totals.update({k: int(v) for k, v in live.get("totals", {}).items() if k in self._totals})
        self._counts.update({k: int(v) for k, v in live.get("counts", {}).items() if k in self._counts})
        for prompt, lease, n in live.get("units", []):
            prompt, n = int(prompt), int(n)
            self._units[(prompt, lease)] = n
            self._shares.setdefault(prompt, set()).add(lease)
            left = self._pool.get(prompt, 0) - n
            if left > 0:
                self._pool[prompt] = left
            else:
                self._pool.pop(prompt, None)
        self._ids = {str(lease): int(i) for lease, i in live.get("ids", {}).items()}
        self._next_id = int(live.get("next_id", 0))
        self._holders = set(self._ids)
        self._joined = set(self._ids) | set(live.get("joined", []))
        self._learner.update({k: v for k, v in live.get("learner", {}).items() if k in LEARNER_FIELDS})
        self._learner_lease = live.get("learner_lease")
        self._endpoint = dict(live.get("endpoint", {}))
        self._calls = CallNumbers(live)
        for lease in self._holders | ({self._learner_lease} if self._learner_lease else set()):
            LEASES.adopt(lease)

    def _dropped(self, fresh: bool = False) -> int:
        stats = self._registry.get_stats(fresh) if self._registry is not None else {}
        return self._totals["dropped_groups"] + int(stats.get("dropped_groups", 0))

    def _save(self, fresh: bool = False) -> None:
        if not self._closed:  # after close, prompts.json alone holds the final state (no journal again)
            self._state.save(self._share_out(fresh))

    def _save_live(self) -> None:
        """Save what only a restarted coordinator needs (who holds which unit, ids, the learner, the endpoint)."""
        if self._restartable:
            self._save()

    def _share_out(self, fresh: bool = False) -> dict:
        """What a resumed service continues from: the next new prompt, the samples still owed, the counters."""
        todo = dict(self._pool)
        for (prompt, _), left in self._units.items():
            todo[prompt] = todo.get(prompt, 0) + left
        totals = {"produced": self._totals["produced"] + self._counts["produced"],
                  "rejected": self._totals["rejected"] + self._counts["rejected"],
                  "dropped_groups": self._dropped(fresh)}
        # "live": what a restarted coordinator of this same service takes back (a resume reads only the rest)
        live = {"totals": dict(self._totals), "counts": dict(self._counts),
                "units": [[p, lease, n] for (p, lease), n in self._units.items()],
                "ids": dict(self._ids), "next_id": self._next_id, "joined": sorted(self._joined - set(self._ids)),
                "learner": dict(self._learner), "learner_lease": self._learner_lease, "endpoint": self._endpoint,
                **self._calls.saved(self._ids)}
        return {"next_prompt": self.next_prompt, "totals": totals, "rejected_reasons": dict(self._reasons),
                "todo": {str(p): n for p, n in sorted(todo.items())}, "live": live}

    # -- collectors --------------------------------------------------------------------------------------------
    def join(self, lease: str, collector_id: int | None = None) -> int:
        """A collector joins under ``lease``; returns its collector id (``collector_id`` if given: ``rbpipe run``
        keeps a restarted collector's id, else the next free one). A lease that joined already keeps its id (a
        join Ray ran again on a restarted coordinator)."""
        with self._lock:
            if collector_id is None and lease in self._ids:
                return self._ids[lease]
            if collector_id is None:  # never an id used before in this service: stored data tells collectors apart
                collector_id = self._next_id
            self._next_id = max(self._next_id, int(collector_id) + 1)
            self._ids[lease] = int(collector_id)
            self._holders.add(lease)
            self._joined.add(lease)
            self._save_live()  # its id and the start-up gate survive a restarted coordinator
            self._changed.notify_all()  # the start-up gate may open
            return int(collector_id)

    def take(self, lease: str) -> dict | None:
        """The next unit for the collector holding ``lease``: ``{"prompt", "samples"}``, or None while the band
        is full (ask again shortly). A dead or unknown lease gets nothing (``{"lease": "expired"}``)."""
        units = self.take_many(lease, 1)
        return units if isinstance(units, dict) else (units[0] if units else None)

    def take_many(self, lease: str, max_units: int, wait_s: float = 0.0, ask: int | None = None) -> list[dict] | dict:
        """Up to ``max_units`` units for ``lease`` in one call, each of another prompt: a collector generates
        them in one batched forward and hands them over in one call. ``[]`` while the band is full; a dead or
        unknown lease gets ``{"lease": "expired"}``. A prompt's units still go to different collectors.

        ``ask``: the caller's number for this call; the same number from the same lease again gets the same
        units, not more (a call Ray ran again on a restarted coordinator, :mod:`rbpipe.service.call_numbers`).

        ``wait_s`` (at most :data:`MAX_TAKE_WAIT_S`): while the band is full, wait up to this long for the
        learner to move it (or a collector to leave) instead of returning ``[]`` at once: the collector starts
        on the new prompts the moment they open, not a polling interval later. Both engines serve calls on
        threads of their own (the local manager one per connection, the Ray coordinator a threaded actor)."""
        if not LEASES.alive(lease) or lease not in self._ids:
            return {"lease": "expired"}
        deadline = time.monotonic() + min(max(float(wait_s), 0.0), MAX_TAKE_WAIT_S)
        with self._lock:
            again = self._calls.take_again(lease, ask, lambda unit: self._units.get((unit["prompt"], lease), 0) > 0)
            if again is not None:
                return again
            while True:
                units = self._take_locked(lease, max_units, ask)
                remaining = deadline - time.monotonic()
                if units or remaining <= 0 or self._stop:
                    return units
                self._changed.wait(remaining)

    def _take_locked(self, lease: str, max_units: int, ask: int | None = None) -> list[dict]:
        self._reclaim()
        opened = self.next_prompt
        taken: dict[int, int] = {}  # prompt -> samples (a collector alone may get a prompt's units at once)
        for _ in range(max(1, int(max_units))):
            unit = self._pick(lease)
            if unit is None:
                break
            prompt, n = unit
            taken[prompt] = taken.get(prompt, 0) + n
            self._units[(prompt, lease)] = self._units.get((prompt, lease), 0) + n
            self._shares.setdefault(prompt, set()).add(lease)  # (the next pick prefers another prompt)
        now = time.monotonic_ns()
        if not taken:
            self._blocked_since.setdefault(lease, now)
            self._publish_blocked(now)
            return []
        since = self._blocked_since.pop(lease, None)
        if since is not None:
            self._counts["insert_blocked_ns"] += now - since
        self._counts["units"] += len(taken)
        units = [{"prompt": prompt, "samples": n} for prompt, n in taken.items()]
        self._calls.took(lease, ask, units)  # journaled with the take itself: it survives the coordinator's death
        if self.next_prompt != opened:  # the total owed changed (a resume needs it)
            self._save()
        else:  # samples moved from the pool to a unit: a restarted coordinator must know who holds which
            self._save_live()
        return [dict(unit) for unit in units]

    def _pick(self, lease: str) -> tuple[int, int] | None:
        """Oldest open prompt first; a prompt's units go to different collectors while another live collector
        still lacks one (groups mix collectors); a new prompt only within the band."""
        live = self._live_holders()
        for prompt in self._pool:
            if lease not in self._shares.get(prompt, ()):
                return prompt, self._from_pool(prompt)
        for prompt in self._pool:  # everyone alive has a share of it: nobody else would finish it
            if all(h in self._shares.get(prompt, ()) for h in live):
                return prompt, self._from_pool(prompt)
        if len(self._joined) < self._expect or not self._band_allows():
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
        self._limiter.set_samples(1, self._dropped())
        return self._limiter.can_insert(1, 0)

    def _publish_blocked(self, now: int) -> None:
        """Collectors' time blocked on the band (all together), where the learner's metrics read it."""
        blocked = self._counts["insert_blocked_ns"] + sum(now - t for t in self._blocked_since.values())
        self._limiter.set_insert_blocked_ns(0, blocked)

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
            self._calls.forget(lease)
            self._ids.pop(lease, None)
        self._holders -= dead
        if back:
            self._counts["reissued_samples"] += sum(back.values())
            merged = {p: n + back.pop(p, 0) for p, n in self._pool.items()}
            self._pool = dict(sorted({**merged, **back}.items()))
        for leases in self._shares.values():
            leases -= dead
        self._save()

    def appended(self, group, lease, n: int = 1) -> None:
        """``n`` trajectories of prompt ``group`` were appended under ``lease``."""
        self.appended_many(lease, {group: n})

    def appended_many(self, lease, counts: dict) -> None:
        """(Registry hook, manager-side.) Trajectories appended under ``lease`` in one call, ``{prompt: n}``
        (work units handed over at once: one save of the prompts still owed, not one per sample)."""
        with self._lock:
            changed = False
            for group, n in counts.items():
                key = (group, lease)
                left = self._units.get(key)
                if left is None:
                    continue  # not a unit's sample (a user's own loop, a requeued payload)
                changed = True
                if left <= n:
                    del self._units[key]
                    if group not in self._pool and not any(p == group for p, _ in self._units):
                        self._shares.pop(group, None)  # the prompt is handed over whole
                else:
                    self._units[key] = left - n
            if changed:
                self._save()

    def reconcile_staged(self, staged: dict) -> None:
        """(A resumed service, before collectors join.) ``{prompt: samples}`` the last session's collectors had
        handed over and the service requeued from staging. A session killed after a collector staged samples
        and before this object recorded them as handed over (``prompts.json``) still lists them as owed: asked
        for again, they were a second group of that prompt. A prompt owes at most what its staged samples leave
        of ``samples_per_prompt`` (staged samples are of groups not yet written: none of the prompt is stored)."""
        with self._lock:
            for prompt, n in staged.items():
                if isinstance(prompt, int) and prompt in self._pool:
                    left = min(self._pool[prompt], max(0, self.samples_per_prompt - int(n)))
                    if left:
                        self._pool[prompt] = left
                    else:
                        del self._pool[prompt]
            self._save()

    def skip(self, lease: str, prompt: int, n: int = 1) -> None:
        """``n`` samples of the caller's unit that will never be handed over (rejected as bad input)."""
        self.appended(prompt, lease, int(n))

    def release(self, lease: str) -> None:
        """A collector (or learner) leaves cleanly: what it still owed goes back to the pool at once."""
        with self._lock:
            self._released.add(lease)
            if lease == self._learner_lease:
                self._learner_lease = None
        LEASES.release(lease)
        with self._lock:
            self._reclaim()
            self._released.discard(lease)
            self._changed.notify_all()  # its units are back in the pool

    # -- the learner -------------------------------------------------------------------------------------------
    def claim_learner(self, lease: str) -> str | None:
        """Make ``lease`` the service's one learner; returns None, or why not (another learner is attached)."""
        with self._lock:
            current = self._learner_lease
            if current is not None and current != lease and LEASES.alive(current):
                return (f"a learner is already attached to this service (step {self._learner['step']}); one "
                        "learner trains a run: stop it first, or attach collectors instead")
            self._learner_lease = lease
            self._learner["done"] = 0
            self._save_live()
            return None

    def report_learner(self, **fields) -> dict[str, float]:
        """The learner's progress (``LEARNER_FIELDS``); returns :meth:`timing`, which it logs with each step."""
        unknown = set(fields) - set(LEARNER_FIELDS)
        if unknown:
            raise ValueError(f"unknown learner fields {sorted(unknown)}; known: {LEARNER_FIELDS}")
        with self._lock:
            self._learner.update(fields)
            self._limiter.set_samples(0, int(self._learner["consumed_groups"]) + int(self._learner["stale_groups"]))
            self._save_live()  # the learner's progress survives a restarted coordinator
            self._changed.notify_all()
        return self.timing()

    def learner(self) -> dict:
        return dict(self._learner)

    # -- counters and progress ---------------------------------------------------------------------------------
    def count(self, produced: int = 0, rejected: int = 0, generate_ns: int = 0, handover_ns: int = 0,
              reasons: dict | None = None, lease: str | None = None, ask: int | None = None) -> None:
        """Collectors' counts and where their time went (generating; handing over to the buffer); ``reasons``:
        why samples were rejected (``{reason: n}``, e.g. a reward that raised), summed run-wide.

        ``lease``, ``ask``: the collector's lease and its number for this call; a number that lease already
        counted is not counted again (a call Ray ran again, :mod:`rbpipe.service.call_numbers`)."""
        with self._lock:
            if not self._calls.first_count(lease, ask):
                return
            for reason, n in (reasons or {}).items():
                self._reasons[str(reason)] = self._reasons.get(str(reason), 0) + int(n)
            self._counts["largest_handover"] = max(self._counts["largest_handover"], int(produced))
            self._counts["produced"] += int(produced)
            self._counts["rejected"] += int(rejected)
            self._counts["generate_ns"] += int(generate_ns)
            self._counts["handover_ns"] += int(handover_ns)
            if produced or rejected or reasons:
                self._save()  # the run's totals: a resumed or restarted coordinator must count every trajectory

    def timing(self) -> dict:
        """Collectors' seconds so far, all collectors together: generating, handing over, blocked by the band."""
        with self._lock:
            blocked = self._counts["insert_blocked_ns"] + sum(time.monotonic_ns() - t
                                                              for t in self._blocked_since.values())
            return {"generate_s": self._counts["generate_ns"] / 1e9, "handover_s": self._counts["handover_ns"] / 1e9,
                    "rate_limited_s": blocked / 1e9}

    def status(self) -> dict:
        """Everything a progress line, a stall report or a summary needs, in one call."""
        with self._lock:
            self._reclaim()
            now = time.monotonic_ns()
            self._publish_blocked(now)
            blocked = sum(now - t for t in self._blocked_since.values())
            totals = {"produced_total": self._totals["produced"] + self._counts["produced"],
                      "rejected_total": self._totals["rejected"] + self._counts["rejected"]}
            return {**self._counts, **totals, "rejected_reasons": dict(self._reasons),
                    "insert_blocked_ns": self._counts["insert_blocked_ns"] + blocked,
                    "next_prompt": self.next_prompt,
                    "open_prompts": len({p for p, _ in self._units} | set(self._pool)),
                    "collectors": {self._ids[h]: h[:8] for h in self._live_holders() if h in self._ids},
                    "band": self._limiter.describe(), "learner": dict(self._learner),
                    "learner_attached": self._learner_lease is not None and LEASES.alive(self._learner_lease)}

    # -- the service's own description -------------------------------------------------------------------------
    def set_endpoint(self, endpoint: dict) -> None:
        with self._lock:
            self._endpoint = dict(endpoint)
            self._save_live()

    def endpoint(self) -> dict:
        """What a worker attaching by ``HOST:PORT`` needs (the same as ``endpoint.json``, key aside)."""
        return dict(self._endpoint)

    def request_stop(self) -> None:
        """Ask every attached worker to finish (``rbpipe serve`` stopping; the learner reached its steps)."""
        with self._lock:
            self._stop = True
            self._changed.notify_all()

    def stop_requested(self) -> bool:
        return self._stop

    def close(self) -> None:
        """(The service, once its workers left.) Save the final share-out with fresh counters as ``prompts.json``
        alone (the journal goes) and remove the band's file. Once: on Ray the engine's shutdown closes it too."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._state.close(self._share_out(fresh=True))  # prompts.json alone holds the final state
        self._limiter.unlink()

