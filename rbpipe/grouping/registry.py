"""``GroupRegistry``: the grouping state, living inside the manager process.

Clients never hold a lock: every method runs inside the manager under a short per-shard
``threading.Lock`` (groups are spread over shards by hash), so a client killed at any instant cannot leave
a lock held, and appends to different groups do not serialise on one lock.

Decisions are torchrl's own: each shard runs a process-local :class:`~torchrl.objectives.llm.MCAdvantage`
on *skeleton* trajectories that carry only the group, the rewards, the done flag and a handle index. The
skeleton group torchrl returns tells which handles were selected and their advantages, so selection,
dynamic sampling, rescue and every counter follow torchrl's semantics by construction. Per-token rewards of
varying length arrive flattened to ``[tokens, 1]`` with their step count (``completed_decisions`` counts
steps, as torchrl does); a custom selector gets ``"return"`` and the ``("trajectories", field)`` entries it
declared, which each writer ships with the reward and which are kept beside the skeletons by handle index.

A completed group becomes a *claim* owned by the appending writer's *lease* (:mod:`rbpipe.grouping.leases`:
a token from :meth:`GroupRegistry.lease` that the writer renews with a heartbeat, and releases when it leaves;
``append`` and ``recover`` renew it too). Its decision counters (written, selected, unselected, ...) stay
deferred, and its members count as queued, until the owner confirms that the storage write succeeded. A claim
whose owner's lease was released or expired (a writer that left, was killed, or froze for longer than the
lease's time to live) is handed to the next caller (``append``/``recover``) to finish. Ownership never looks
at a PID: a writer in another PID namespace, container or host is owned by its lease like any other. An
owner that is not a lease token (an int, as older callers passed PIDs) counts as dead. A claim's id is
the storage commit id (``commit_id``) so a finished-but-unconfirmed write (e.g. by a writer whose lease expired while it
wrote) is not duplicated by storages that support idempotent commits.

A claim that cannot be written is *quarantined* instead of being handed on until every writer has died of it:
when a writer reports that its write failed, or when its writers' leases died ``MAX_WRITER_DEATHS`` times. It is then
counted as a dropped group (reason ``quarantined``) and recorded (:meth:`GroupRegistry.quarantined`). A group
whose advantages come out non-finite from finite rewards (a return that overflows, the std of one value) is
dropped too (reason ``nonfinite_advantage``): torchrl would write NaNs. Every trajectory handed over stays
exactly one of written, dropped with a counted reason, or queued: a decision that raises (a custom selector,
whatever it raises, ``SystemExit`` included: reason ``selector_error``; anything else: ``decision_error``) drops
its group instead of leaving it queued, and the manager's connection thread that ran it lives on. A writer
confirms (or quarantines) a claim under the lease it was handed to: once another writer took it over, the first
is refused, so a claim is confirmed once.

Size (over 500 lines): one class, the methods the manager proxy exposes (append, confirm, recover, quarantine,
counters, leases); they share its state (shards, claims, deferred counters, row ranges) under its locks.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from tensordict import TensorDict, lazy_stack
from torchrl.objectives.llm import MCAdvantage, MCAdvantageSelector

from rbpipe.grouping.leases import LEASES, LeaseAuthority, LeaseTable
from rbpipe.trajectory import numpy_view

_G, _R, _D, _A, _H = "group", "reward", "done", "advantage", "handle"

#: torchrl's counters (torchrl.objectives.llm.grpo._MCADVANTAGE_STATS; listed here to stay version-explicit).
STAT_NAMES = ("completed_trajectories", "completed_decisions", "trajectory_return_sum", "trajectory_return_max",
              "successful_trajectories", "completed_groups", "written_groups", "dropped_groups", "rescued_groups",
              "selected_trajectories", "unselected_trajectories")
#: Counters that describe a group decision: held back until its storage write is confirmed.
DEFERRED = ("completed_groups", "written_groups", "rescued_groups", "selected_trajectories",
            "unselected_trajectories")
QUEUE_STATS = ("queued_groups", "queued_trajectories", "max_queued_trajectories_per_group")
#: Counters that are maxima, not sums, when several shards' counters make one registry's.
MAX_STATS = ("trajectory_return_max", "max_queued_trajectories_per_group")


def sum_stats(parts: Iterable[Mapping[str, Any]]) -> dict:
    """Several shards' counters as one registry's (:data:`MAX_STATS` by maximum, the rest by sum): the one sum
    for the shards inside a manager and the Ray engine's shard actors.

    Examples:
        >>> a = {"written_groups": 2, "trajectory_return_max": 1.0}
        >>> sum_stats([a, {"written_groups": 3, "trajectory_return_max": 0.5}])
        {'written_groups': 5, 'trajectory_return_max': 1.0}
    """
    total: dict[str, Any] = {}
    for part in parts:
        for name, value in part.items():
            if name not in total:
                total[name] = value
            elif name in MAX_STATS:
                total[name] = max(total[name], value)
            else:
                total[name] += value
    return total


#: Why groups were dropped besides torchrl's own dynamic sampling (counted in ``dropped_groups`` too).
DROP_REASONS = ("quarantined", "nonfinite_advantage", "selector_error", "decision_error")
#: A claim whose writers' leases died this many times while holding it is quarantined, not handed on again.
MAX_WRITER_DEATHS = 3
#: (Manager process.) Temporary staging directories removed when the manager exits (its owner died, shutdown).
TEMPORARY_STAGING: set[str] = set()
_STAT_SET = frozenset(STAT_NAMES)
_DONE: dict[int, torch.Tensor] = {}  # steps -> done column of a skeleton (only the last step done)


def encode_tensor(t: torch.Tensor) -> tuple[bytes, str, tuple]:
    view = numpy_view(t)  # a plain CPU tensor: no detach/cpu/contiguous dispatch (tobytes copies in C order)
    if view is None:  # bytes through a uint8 view: also for dtypes numpy has not (bfloat16)
        t = t.detach().cpu().contiguous()
        view = t.reshape(-1).view(torch.uint8).numpy()
    return view.tobytes(), str(t.dtype)[6:], tuple(t.shape)


def decode_tensor(data: bytes, dtype: str, shape: tuple) -> torch.Tensor:
    dt = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(data), dtype=dt).reshape(shape)


class _Step:
    """One step of a skeleton, as torchrl reads it: one key (``td[-1][done_key]``, ``td[0][prompt_key]``)."""

    __slots__ = ("_leaves", "_index")

    def __init__(self, leaves: dict, index: int) -> None:
        self._leaves, self._index = leaves, index

    def __getitem__(self, key):
        return self._leaves[key][self._index]


class _Skeleton(TensorDict):
    """A skeleton trajectory. torchrl reads one step of it twice per decision (``td[-1]``, ``td[0]``), one
    key each time; the general TensorDict indexing path cost a large part of a decision, and a TensorDict of
    every leaf's row still a visible part of the manager's time (figures: docs/DESIGN.md, Figures behind code choices):
    an integer step is a view of the one leaf asked for."""

    def __getitem__(self, index):
        if type(index) is int:
            return _Step(self._tensordict, index)
        return super().__getitem__(index)


class _SkeletonMCAdvantage(MCAdvantage):
    """torchrl's ``MCAdvantage``, fed skeletons only. A skeleton is built concrete (plain tensors, no lazy
    stack, no non-tensor leaves), so torchrl's per-trajectory materialisation check, a large part of the
    decision's cost, has nothing to do and is skipped."""

    @staticmethod
    def _concrete_if_possible(tensordict: TensorDict) -> TensorDict:
        return tensordict

    def __setattr__(self, name: str, value) -> None:
        # Counters are properties (torchrl's _set_stat): nn.Module.__setattr__'s parameter/buffer/submodule
        # checks before reaching them cost a visible part of a decision, several times per trajectory.
        if name in _STAT_SET:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    @staticmethod
    def _cat_tensordicts(tensordicts: list[TensorDict], dim: int = 0) -> TensorDict:
        return torch.cat(tensordicts, dim)  # skeletons are concrete: torchrl's per-member check is moot


class SelectorFailed(Exception):
    """A custom ``candidate_selector`` raised: its group is dropped (reason ``selector_error``)."""


class _FieldSelector(MCAdvantageSelector):
    """Runs a custom selector on what it declared: ``"return"`` and the ``("trajectories", key)`` fields each
    writer shipped with the trajectory's reward (a skeleton has none of them), looked up by handle index."""

    def __init__(self, inner: MCAdvantageSelector, fields: dict) -> None:
        self.inner, self.fields = inner, fields
        self.in_keys = ["return", "trajectories"]

    def select(self, candidates, *, group_size: int, keep_return_bounds=None):
        try:
            view = TensorDict({"return": candidates.get("return")}, batch_size=candidates.batch_size)
            if any(k != "return" for k in self.inner.in_keys):  # fields declared: shipped with the rewards
                hids = [int(t.get(_H)[0]) for t in candidates.get("trajectories").unbind(0)]
                view.set("trajectories", lazy_stack([self.fields[h] for h in hids], 0))
            return self.inner.select(view.select(*self.inner.in_keys, strict=True), group_size=group_size,
                                     keep_return_bounds=keep_return_bounds)
        except BaseException as err:  # noqa: BLE001 - user code (SystemExit too): its group is dropped, and the
            # manager's connection thread that runs it lives on (a BaseException would end it: the writer's
            # connection lost, the group left queued for the next writer to lose its connection the same way)
            raise SelectorFailed(f"{type(err).__name__}: {err}") from err

    def _accepted(self, *args):
        try:
            return self.inner._accepted(*args)
        except BaseException as err:  # noqa: BLE001 - user code too (torchrl asks it whether a group was rescued)
            raise SelectorFailed(f"{type(err).__name__}: {err}") from err


def _fields_td(reward: tuple) -> TensorDict:
    """The fields a selector reads, shipped as the 5th element of a reward message, as one trajectory."""
    steps = reward[3] if reward[3] is not None else reward[2][0]
    td = TensorDict(batch_size=[steps])
    for key, enc in reward[4]:
        td.set(tuple(key), decode_tensor(*enc))
    return td


def shard_of(group, shards: int) -> int:
    """The registry shard of group key ``group``: a hash that is the same in every process and every run
    (Python's ``hash`` of a str is salted per process). The one shard function of both engines: the Ray
    engine's registry shards are placed by it and their logs (``shard-<index>.log``) replayed by it, so it must
    not change; the local registry stripes its locks with it too."""
    if shards <= 1:
        return 0
    if isinstance(group, bool) or not isinstance(group, int):
        try:
            group = int(group)  # numpy / 0-d tensor ints hash like ints
        except (TypeError, ValueError):
            return zlib.crc32(repr(group).encode()) % shards
    return zlib.crc32(str(group).encode()) % shards


class _Shard:
    def __init__(self, options: dict) -> None:
        self.lock = threading.Lock()
        selector = options.get("candidate_selector")
        self.fields: dict[int, TensorDict] = {}  # hidx -> fields a custom selector reads
        if selector is not None and (type(selector) is not MCAdvantageSelector
                                     or [str(k) for k in selector.in_keys] != ["return"]):
            options = dict(options, candidate_selector=_FieldSelector(selector, self.fields))
        self.mc = _SkeletonMCAdvantage(prompt_key=_G, rewards_key=_R, advantage_key=_A, done_key=_D, **options)
        self.group_ids: dict[Any, int] = {}  # group -> int id used in skeletons, while queued
        self.members: dict[int, list[tuple[int, str, tuple]]] = {}  # int id -> [(hidx, handle, reward enc)]
        self.ids = itertools.count()
        self.hids = itertools.count()


class GroupRegistry(LeaseAuthority):
    """Shared grouping state; its public methods are what the manager proxy exposes (the lease calls are
    :class:`~rbpipe.grouping.leases.LeaseAuthority`'s, over the manager process's one table)."""

    exposed = ("append", "append_many", "confirm", "confirm_many", "unconfirmed", "recover", "get_stats",
               "reset_stats", "clear_queues", "ping", "options", "quarantine", "quarantined", "drop_reasons",
               "watch_temporary", "join_info", "lease", "renew", "release", "lease_ttl")

    def __init__(self, options: dict, shards: int = 16, orphan_check_s: float = 0.5,
                 staging: dict | None = None, leases: LeaseTable | None = None) -> None:
        self._options = dict(options)
        # (manager-side) on_append(owner, {group: n}): the samples of each group appended in one call
        self.on_append: Callable[[Any, dict[Any, int]], None] | None = None
        self._leases = LEASES if leases is None else leases  # the manager process's one table
        self.staging = dict(staging) if staging else None
        self._quarantine: list[dict] = []
        self._reasons = {name: 0 for name in DROP_REASONS}
        self._shards = [_Shard(self._options) for _ in range(max(1, int(shards)))]
        self._claims: dict[str, dict] = {}
        self._claims_lock = threading.Lock()
        self._rows = 0  # next free row for storages that need reserved row ranges
        self._free_rows: list[tuple[int, int]] = []  # (start, size) of quarantined groups' ranges, to reuse
        self._rows_lock = threading.Lock()
        self._orphan_check_s = orphan_check_s
        self._last_orphan_check = 0.0

    # -- helpers -----------------------------------------------------------------------------------------------
    def ping(self) -> int:
        return os.getpid()

    def options(self) -> dict:
        return dict(self._options)

    def join_info(self) -> dict:
        return {"options": dict(self._options), "staging": self.staging}

    def watch_temporary(self, path: str) -> None:
        """Remove the temporary staging directory ``path`` when the manager exits (e.g. its owner was killed)."""
        TEMPORARY_STAGING.add(str(path))

    def _shard(self, group) -> _Shard:
        return self._shards[shard_of(group, len(self._shards))]

    @staticmethod
    def _skeleton(gid: int, hidx: int, reward: tuple) -> TensorDict:
        r = decode_tensor(*reward[:3])  # a 4th element: the step count of flattened per-token rewards
        steps = r.shape[0]
        done = _DONE.get(steps)
        if done is None:  # shared between skeletons: nothing writes into a queued trajectory
            done = torch.zeros(steps, 1, dtype=torch.bool)
            done[-1] = True
            _DONE[steps] = done
        return _Skeleton._new_unsafe({_G: torch.full((steps,), gid, dtype=torch.int64), _R: r, _D: done,
                                       _H: torch.full((steps,), hidx, dtype=torch.int64)},
                                      batch_size=torch.Size([steps]))

    def _reserve_rows(self, n: int) -> int:
        """Rows for a group of ``n``: a quarantined group's range of that size first (so a hole it left inside
        ``len(storage)`` is overwritten by the next group), else new rows at the end."""
        with self._rows_lock:
            for i, (start, size) in enumerate(self._free_rows):
                if size == n:
                    del self._free_rows[i]
                    return start
            start = self._rows
            self._rows += n
            return start

    # -- the one call per trajectory ---------------------------------------------------------------------------
    def append(self, group, handle: str, reward: tuple, owner, reserve_rows: bool = False) -> dict:
        """Queue one trajectory; return ``{"status": "queued"|"write"|"dropped", ...}`` plus orphan claims.

        ``reward`` is ``(bytes, dtype, shape)`` of the trajectory's reward tensor (``shape[0]`` = steps).
        """
        return self.append_many([(group, handle, reward)], owner, reserve_rows)[0]

    def append_many(self, items: list[tuple], owner, reserve_rows: bool = False) -> list[dict]:
        """Queue ``(group, handle, reward)`` items in order, in one round trip: a collector hands a whole work
        unit over at once. One decision per item, exactly as :meth:`append` would give them one by one; claims
        of dead writers come with the last."""
        results = [self._append_one(group, handle, reward, owner, reserve_rows) for group, handle, reward in items]
        self.renew(owner)  # every call is a heartbeat too
        if self.on_append is not None:  # a service's coordinator: samples of work units were handed over
            counts: dict[Any, int] = {}
            for group, _, _ in items:
                counts[group] = counts.get(group, 0) + 1
            self.on_append(owner, counts)
        for result in results:
            result["recovered"] = []
        if results:
            results[-1]["recovered"] = self._orphans(owner)
        return results

    def _append_one(self, group, handle: str, reward: tuple, owner, reserve_rows: bool) -> dict:
        shard = self._shard(group)
        with shard.lock:
            gid = shard.group_ids.get(group)
            if gid is None:
                gid = shard.group_ids[group] = next(shard.ids)
                shard.members[gid] = []
            hidx = next(shard.hids)
            shard.members[gid].append((hidx, handle, reward))
            if len(reward) > 4 and reward[4]:
                shard.fields[hidx] = _fields_td(reward)
            mc = shard.mc
            before = {name: mc._stats[name] for name in DEFERRED}
            failed: BaseException | None
            result: dict[str, Any]
            try:
                out = mc._inv_call_single(self._skeleton(gid, hidx, reward))  # torchrl's per-trajectory decision
            except BaseException as err:  # noqa: BLE001 - a decision that raised must not leave its group stuck,
                # nor end the connection thread (a SystemExit from user code would)
                out, failed = None, err
                mc._queue_delete(gid)
                mc.completed_groups += 1
                mc.dropped_groups += 1
            else:
                failed = None
            if len(reward) > 3 and reward[3] is not None:  # torchrl counts steps, not flattened tokens
                mc._stats["completed_decisions"] += reward[3] - reward[2][0]
            if gid in mc.queues:
                result = {"status": "queued"}
            else:
                members = shard.members.pop(gid)
                del shard.group_ids[group]
                if shard.fields:
                    for hid, _, _ in members:
                        shard.fields.pop(hid, None)
                if failed is not None:
                    result = self._drop_failed(group, members, failed)
                elif out is None:
                    result = {"status": "dropped", "handles": [h for _, h, _ in members]}
                else:
                    deltas = {name: mc._stats[name] - before[name] for name in DEFERRED}
                    if not bool(torch.isfinite(out.get(_A)).all()):
                        result = self._drop_nonfinite(mc, group, members, deltas)
                    else:
                        result = self._new_claim(group, members, out, deltas, owner, reserve_rows)
        return result

    def _drop_failed(self, group, members, err: BaseException) -> dict:
        """The group's decision raised (its custom selector, or members whose rewards do not combine): the group
        was dropped (counted), not left stuck in its queue."""
        handles = [h for _, h, _ in members]
        if isinstance(err, SelectorFailed):
            self._reasons["selector_error"] += 1
            return {"status": "dropped", "handles": handles, "reason": "selector_error",
                    "message": f"group {group!r} was dropped: its candidate_selector raised {err}. Fix the selector "
                               "(it runs in the grouping manager and sees 'return' and the ('trajectories', key) "
                               "fields listed in its in_keys)"}
        self._reasons["decision_error"] += 1
        return {"status": "dropped", "handles": handles, "reason": "decision_error",
                "message": f"group {group!r} was dropped: its advantages could not be computed "
                           f"({type(err).__name__}: {err}). Give every member rewards of one layout"}

    def _drop_nonfinite(self, mc: MCAdvantage, group, members, deltas: dict) -> dict:
        """torchrl decided to write a group whose advantages are not finite: count it dropped instead, its
        trajectories no longer selected (nor the group rescued); those the selection left out stay unselected."""
        mc._stats["written_groups"] -= deltas["written_groups"]
        mc._stats["selected_trajectories"] -= deltas["selected_trajectories"]
        mc._stats["rescued_groups"] -= deltas["rescued_groups"]
        mc._stats["dropped_groups"] += 1
        self._reasons["nonfinite_advantage"] += 1
        rewards = [float(decode_tensor(*r[:3]).double().sum()) for _, _, r in members]
        return {"status": "dropped", "handles": [h for _, h, _ in members], "reason": "nonfinite_advantage",
                "message": f"group {group!r} was dropped: its advantages are not finite although every reward is "
                           f"(trajectory reward sums {rewards[:8]}): a return overflowed float32, or a group of "
                           "one value has no std (grpo_size=1 with one-step trajectories). Scale the rewards "
                           "down, or use a larger grpo_size"}

    def _new_claim(self, group, members, out: TensorDict, deltas: dict, owner, reserve_rows: bool) -> dict:
        handle_of = {hidx: handle for hidx, handle, _ in members}
        hcol, counts = torch.unique_consecutive(out.get(_H), return_counts=True)
        advs = out.get(_A).split(counts.tolist(), dim=0)
        selected = [handle_of[int(h)] for h in hcol.tolist()]
        claim = {
            "commit_id": self._commit_id(members), "group": group, "selected": selected,
            "advantages": [encode_tensor(a) for a in advs],
            "unselected": [h for _, h, _ in members if h not in set(selected)],
            "members": [(h, r) for _, h, r in members], "deltas": deltas, "owner": owner,
            "since": time.monotonic(), "deaths": 0,
            "rows": self._reserve_rows(int(counts.sum())) if reserve_rows else None, "nrows": int(counts.sum()),
        }
        with self._claims_lock:
            self._claims[claim["commit_id"]] = claim
        return {"status": "write", **self._public(claim)}

    def _commit_id(self, members) -> str:
        """A new claim's commit id (its id, and the store's): random here. The Ray engine's shards derive it from
        the members' handles, so that a group formed again by replaying a shard's log keeps its id."""
        return uuid.uuid4().hex

    @staticmethod
    def _public(claim: dict) -> dict:
        return {k: claim[k] for k in ("commit_id", "group", "selected", "advantages", "unselected", "rows")}

    def _orphans(self, owner, force: bool = False) -> list[dict]:
        now = time.monotonic()
        if not self._claims or (not force and now - self._last_orphan_check < self._orphan_check_s):
            return []
        self._last_orphan_check = now
        taken = []
        with self._claims_lock:
            for claim in list(self._claims.values()):
                if claim["owner"] != owner and not self._leases.alive(claim["owner"]):
                    claim["deaths"] = claim.get("deaths", 0) + (claim["owner"] != 0)  # 0: restored, no owner yet
                    if claim["deaths"] >= MAX_WRITER_DEATHS:
                        reason = (f"its writers died {claim['deaths']} times while writing it (their leases "
                                  f"expired or were released; last owner: {claim['owner']})")
                        record = self._quarantine_locked(claim["commit_id"], reason)
                        taken.append(dict(self._public(claim), quarantine=record))
                        continue
                    claim["owner"], claim["since"] = owner, now
                    taken.append(self._public(claim))
        return taken

    def confirm(self, commit_id: str, owner=None) -> bool:
        """The claim's group is in storage: release its deferred counters. Idempotent. With ``owner`` (the lease
        token the claim was handed to), only while the claim is still that owner's: a writer whose lease expired
        (frozen, stalled) and whose claim another writer took over is refused (False), so one of the two, never
        both, confirms it."""
        with self._claims_lock:
            return self._confirm_locked(commit_id, owner)

    def confirm_many(self, commit_ids: list[str], owner=None) -> list[bool]:
        """:meth:`confirm` each of the groups one hand-over wrote, in one round trip."""
        with self._claims_lock:
            return [self._confirm_locked(commit_id, owner) for commit_id in commit_ids]

    def _confirm_locked(self, commit_id: str, owner) -> bool:
        claim = self._claims.get(commit_id)
        if claim is None or owner is not None and claim["owner"] != owner:
            return False
        del self._claims[commit_id]
        return True

    def unconfirmed(self) -> list[tuple[str, list[str]]]:
        """``(commit id, member handles)`` of every claim not confirmed yet: lets the service confirm, at the end
        of a run, those whose group a writer stored and was killed before confirming."""
        with self._claims_lock:
            return [(cid, list(c["selected"]) + list(c["unselected"])) for cid, c in self._claims.items()]

    def recover(self, owner, force: bool = False) -> list[dict]:
        """Hand the caller (``owner``: its lease token, renewed by the call) every claim whose owner's lease is
        dead (``force``: every claim not its own)."""
        self.renew(owner)
        if force:
            with self._claims_lock:
                now = time.monotonic()
                taken = []
                for claim in self._claims.values():
                    if claim["owner"] != owner:
                        claim["owner"], claim["since"] = owner, now
                        taken.append(self._public(claim))
                return taken
        return self._orphans(owner, force=True)

    # -- quarantine --------------------------------------------------------------------------------------------
    def quarantine(self, commit_id: str, reason: str, owner=None) -> dict | None:
        """A writer could not write this claim: drop it with reason ``quarantined`` (never handed on again);
        returns its record (None if it was confirmed or quarantined already, or, with ``owner``, if another
        writer took it over: a late writer's failure says nothing about the group)."""
        with self._claims_lock:
            claim = self._claims.get(commit_id)
            if claim is None or owner is not None and claim["owner"] != owner:
                return None
            return self._quarantine_locked(commit_id, reason)

    def _quarantine_locked(self, commit_id: str, reason: str) -> dict:
        claim = self._claims.pop(commit_id)
        record = {"commit_id": commit_id, "group": claim["group"], "reason": str(reason),
                  "handles": list(claim["selected"]) + list(claim["unselected"]), "rows": claim["rows"],
                  "time": time.time()}
        self._quarantine.append(record)
        self._reasons["quarantined"] += 1
        if claim["rows"] is not None and claim.get("nrows"):
            with self._rows_lock:
                self._free_rows.append((claim["rows"], claim["nrows"]))
        mc = self._shards[0].mc  # counters are summed over shards: any shard may carry the correction
        with self._shards[0].lock:
            mc._stats["written_groups"] -= claim["deltas"].get("written_groups", 0)
            mc._stats["dropped_groups"] += 1
        return record

    def quarantined(self) -> list[dict]:
        """Records of quarantined groups: commit id, group, handles (payloads under ``quarantine/<commit id>/``
        of the staging directory), reason, reserved rows, time."""
        with self._claims_lock:
            return [dict(r) for r in self._quarantine]

    def drop_reasons(self) -> dict:
        """Groups dropped for a reason of rbpipe's own (also counted in ``dropped_groups``)."""
        return dict(self._reasons)

    # -- stats -------------------------------------------------------------------------------------------------
    def get_stats(self, fresh: bool = False) -> dict:
        """The counters summed over the shards, always current (read under their locks): ``fresh`` is for
        callers that also read Ray's sharded registry, whose counters may lag (the coordinator)."""
        parts: list[dict[str, Any]] = []
        queue_lens: list[int] = []
        for shard in self._shards:
            with shard.lock:
                parts.append({name: shard.mc._stats[name] for name in STAT_NAMES})
                queue_lens.extend(len(q) for q in shard.mc.queues.values())
        stats = sum_stats(parts)
        with self._claims_lock:
            for claim in self._claims.values():
                for name, delta in claim["deltas"].items():
                    stats[name] -= delta
                queue_lens.append(len(claim["members"]))
        stats.update(queued_groups=len(queue_lens), queued_trajectories=sum(queue_lens),
                     max_queued_trajectories_per_group=max(queue_lens, default=0))
        return stats

    def reset_stats(self) -> None:
        for shard in self._shards:
            with shard.lock:
                shard.mc.reset_stats()
        with self._claims_lock:
            for claim in self._claims.values():
                claim["deltas"] = {name: 0 for name in DEFERRED}

    def clear_queues(self) -> list[str]:
        """Forget incomplete groups (not claims); returns their staged handles so the caller can delete them."""
        dropped: list[str] = []
        for shard in self._shards:
            with shard.lock:
                shard.mc.clear_queues()
                dropped.extend(h for members in shard.members.values() for _, h, _ in members)
                shard.members.clear()
                shard.fields.clear()
                shard.group_ids.clear()
        return dropped


_REGISTRIES: dict[str, GroupRegistry] = {}
_REGISTRIES_LOCK = threading.Lock()


def get_registry(name: str, options: dict | None = None, shards: int = 16,
                 staging: dict | None = None) -> GroupRegistry:
    """Manager-side factory: one registry per name (created on first use, with ``options`` and ``staging``).
    A joiner checks what it joined with :func:`join_problem` (an error raised in here would reach it as a
    traceback string)."""
    with _REGISTRIES_LOCK:
        reg = _REGISTRIES.get(name)
        if reg is None:
            if options is None:
                raise KeyError(f"no grouping registry named {name!r} in this manager")
            reg = _REGISTRIES[name] = GroupRegistry(options, shards=shards, staging=staging)
        return reg


def join_problem(name: str, joined: dict, options: dict | None, staging: dict | None) -> str | None:
    """Why a transform with ``options``/``staging`` must not share registry ``name`` (``joined``: the registry's
    :meth:`~GroupRegistry.join_info`), or None. Grouping silently with options its caller did not ask for, or
    handing out handles it cannot read, is never right."""
    theirs = joined["options"]
    if options is not None:
        diff = [k for k in sorted(set(options) | set(theirs))
                if _canonical(options.get(k)) != _canonical(theirs.get(k))]
        if diff:
            shown = ", ".join(f"{k}={options.get(k)!r} (the registry has {theirs.get(k)!r})" for k in diff)
            return (f"grouping registry {name!r} already exists with other options: {shown}. Build every "
                    "transform that shares it with the same options, or use another name")
    path = (joined.get("staging") or {}).get("path")
    if staging is not None and path is not None and staging["path"] != path:
        hint = (" (no staging_dir given: a private temporary directory, which other processes cannot read)"
                if staging.get("temporary") else "")
        return (f"grouping registry {name!r} stages payloads in {path}, this transform in {staging['path']}"
                f"{hint}: every process sharing a registry must share its staging directory; pass "
                f"staging_dir={path!r}")
    return None


def _canonical(value):
    """A comparable form of an option value (a selector object compares by type and attributes)."""
    if isinstance(value, (list, tuple)):
        return tuple(_canonical(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _canonical(v)) for k, v in value.items()))
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    attrs = getattr(value, "__dict__", None)
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    if attrs is None or callable(value) and not attrs:
        return name
    return name, tuple(sorted((k, _canonical(v)) for k, v in attrs.items() if not k.startswith("__")))
