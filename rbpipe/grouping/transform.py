"""``SharedMCAdvantage``: torchrl's ``MCAdvantage`` with its queues in a manager, moving handles only.

Per trajectory: validate, stage the payload once (on disk), make **one** manager call carrying the group,
the handle and the reward tensor. The answer is "queued", "dropped" (delete the staged files) or a *claim*
for a completed group (selected handles + torchrl's advantages); the completing writer loads the payloads,
sets the advantages, writes the group to storage outside any lock and confirms.

A claim is owned by the writing process's *lease* (:mod:`rbpipe.grouping.leases`), not by its PID: each
process takes one from the manager on first use (a forked child takes its own), renews it from a daemon
heartbeat thread every third of its time to live, and releases it on :meth:`SharedMCAdvantage.close` and at
exit, so the claims of a writer that leaves are handed on at once, and those of one that is killed (or
frozen) once its lease expires, whatever PID namespace, container or host it runs in.

Size (over 500 lines): torchrl's ``MCAdvantage`` face (``inv``, counters, queues) plus the claim's life (process,
load, confirm, quarantine, recover, requeue) on one set of state; the process lease is
:mod:`rbpipe.grouping.lease_client`, claims are :mod:`rbpipe.grouping.claims`.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.objectives.llm import MCAdvantage, MCAdvantageSelector

from rbpipe.errors import BadTrajectoryError, ConfigError
from rbpipe.grouping.claims import Claim, ClaimLostWarning, warn_lost
from rbpipe.grouping.lease_client import LEASE_LOCK, ProcessLease
from rbpipe.grouping.leases import ttl_from_env
from rbpipe.grouping.manager import call, open_registry, start_manager
from rbpipe.grouping.registry import QUEUE_STATS, STAT_NAMES, decode_tensor, encode_tensor
from rbpipe.grouping.staging import (
    PLAIN,
    Staging,
    decode_leaves,
    encode_td,
    remove_at_exit,
    td_from_leaves,
    temporary_staging_parent,
)
from rbpipe.members import concat_leaves
from rbpipe.trajectory import GROUP_KEY, REQUIRED_KEYS, flat_reward, leaf_steps, numpy_view, validate_trajectory


def refuse_stdlib_spawn() -> None:
    """Refuse, in the parent and in one line, to send the transform to a child started by stdlib (or torch)
    ``spawn``/``forkserver``: the manager's authkey travels only with ``multiprocess``'s own spawner, and the
    child would fail with ``AuthenticationError`` when it first reached the manager."""
    import multiprocessing.context as std_context

    import multiprocess.context as mp_context

    popen = std_context.get_spawning_popen()
    if popen is not None and mp_context.get_spawning_popen() is None:
        method = getattr(popen, "method", "spawn")
        raise ConfigError(f"a SharedMCAdvantage (or a buffer holding one) cannot be sent to a child started by "
                          f"stdlib/torch multiprocessing with the {method!r} start method: it could not "
                          "authenticate to the grouping manager. Start writers with the `multiprocess` package "
                          "(rbpipe.system.procs.worker_context(), or "
                          "multiprocess.get_context('spawn'|'forkserver'|'fork')), "
                          "or with a stdlib/torch 'fork' context, or join from the child with connect_manager")


def selector_fields(selector: MCAdvantageSelector) -> tuple[tuple[str, ...], ...]:
    """The trajectory fields a selector declares (``("trajectories", *key)`` in its ``in_keys``), shipped to
    the manager with each reward; any key but those and ``"return"`` cannot be given there: refused now."""
    fields = []
    for key in selector.in_keys:
        parts = (key,) if isinstance(key, str) else tuple(key)
        if parts == ("return",):
            continue
        if len(parts) < 2 or parts[0] != "trajectories":
            raise ConfigError(f"candidate_selector in_keys has {key!r}: SharedMCAdvantage runs selectors in its "
                              "grouping manager and gives them 'return' and ('trajectories', <field>) keys only "
                              "(the field then travels with each trajectory's reward); use one of those")
        fields.append(parts[1:])
    return tuple(fields)


class SharedMCAdvantage(MCAdvantage):
    """Drop-in shared ``MCAdvantage`` (same options, outputs and ``get_stats()``) for many writer processes.

    Its defaults are torchrl's (``prompt_key="query"``, string or tensor group ids) and it takes what torchrl's
    LLM stack produces: lazy-stacked steps whose per-token rewards and tokens differ in length, ``str`` leaves
    (``NonTensorData``, read back exactly). Where it differs from ``MCAdvantage``:

    - every trajectory is checked before anything is queued (:class:`~rbpipe.errors.BadTrajectoryError`):
      ``required_keys`` must be present, the last step done, rewards floating point and finite;
    - a leaf that is neither a tensor nor a ``str`` is refused (payloads are staged without pickle);
    - with ``trajectory_return``, per-token rewards of varying length are reduced over every token of the
      trajectory (torchrl cannot stack them and raises);
    - ``candidate_selector`` runs in the manager process: a custom selector reads ``"return"`` and the
      ``("trajectories", key)`` fields it lists in ``in_keys`` (shipped with each trajectory's reward; tensors
      of one row per step), nothing else; other keys are refused at construction. A selector that raises
      (anything, ``SystemExit`` included) drops its group (reason ``selector_error``; any other failed decision:
      ``decision_error``) instead of leaving it queued for good, and the writer's connection stays up;
    - groups whose advantages are not finite are dropped (reason ``nonfinite_advantage``; not counted as
      selected);
    - a writer whose lease expired while it held a claim (frozen, stalled) and that another writer took over
      is refused when it confirms it (:class:`ClaimLostWarning`): ``inv()`` returns each group to one caller;
    - it can be sent to writer processes started by ``multiprocess`` (any start method) or forked; stdlib/torch
      ``spawn`` and ``forkserver`` are refused in the parent (the child could not authenticate to the manager).

    Keyword Args (on top of ``MCAdvantage``'s):
        manager: a :func:`~rbpipe.grouping.start_manager` manager (or connected one); ``None`` starts one.
        staging_dir: directory for staged payloads (e.g. ``STORE/staging``, which a restarted run resumes
            from); ``None``: a temporary one in shared memory (``/dev/shm``), removed by :meth:`shutdown`.
        name: registry name inside the manager (independent processes open the same name).
        required_keys: keys every trajectory must carry (default: the rbpipe schema's when ``prompt_key`` is
            ``"group_id"``, else ``prompt_key``, ``rewards_key`` and ``done_key``).
        shards: lock shards of the registry.
        reserve_rows: ask the registry for row ranges (for torchrl storages without ``append_group``).
    """

    def __init__(self, grpo_size: int, prompt_key="query", rewards_key=("next", "reward"),
                 advantage_key="advantage", done_key=("next", "done"), verbose: bool = False, *,
                 trajectory_return=None, keep_return_bounds=None, candidate_group_size=None,
                 candidate_selection_min_size=None, candidate_selector: MCAdvantageSelector | None = None,
                 manager=None, staging_dir=None, name: str | None = None, required_keys=None, shards: int = 16,
                 reserve_rows: bool = False) -> None:
        try:
            super().__init__(grpo_size, prompt_key, rewards_key, advantage_key, done_key, verbose,
                             trajectory_return=trajectory_return, keep_return_bounds=keep_return_bounds,
                             candidate_group_size=candidate_group_size,
                             candidate_selection_min_size=candidate_selection_min_size,
                             candidate_selector=candidate_selector)
        except ValueError as err:
            raise ConfigError(f"invalid grouping options: {err}") from err
        try:
            ttl_from_env()
        except ValueError as err:
            raise ConfigError(str(err)) from err
        options = dict(grpo_size=grpo_size, trajectory_return=trajectory_return,
                       keep_return_bounds=self.keep_return_bounds, candidate_group_size=self.candidate_group_size,
                       candidate_selection_min_size=self.candidate_selection_min_size,
                       candidate_selector=self.candidate_selector)
        if name is None and getattr(manager, "joined", False):
            raise ConfigError("this manager was joined with connect_manager: pass name=... (the same in every "
                              "process) so the processes share one grouping registry; without it each process "
                              "groups alone and groups spread over processes never complete")
        self._owns_manager = manager is None
        self._manager = start_manager() if manager is None else manager
        self.registry_name = name or f"grouping-{uuid.uuid4().hex[:12]}"
        self._owns_staging = staging_dir is None
        if staging_dir is None:
            import tempfile

            staging_dir = Path(tempfile.mkdtemp(prefix="rbpipe-staging-", dir=temporary_staging_parent()))
        self.staging = Staging(staging_dir)
        try:
            self._registry = open_registry(self._manager, self.registry_name, options, shards,
                                           {"path": str(self.staging.path), "temporary": self._owns_staging})
        except BaseException:
            self.shutdown()
            raise
        if self._owns_staging:
            remove_at_exit(self.staging.path)  # a clean exit without shutdown() leaves nothing in /dev/shm
            call(self._registry, "watch_temporary", str(self.staging.path))  # nor a killed owner
        if required_keys is None:
            required_keys = REQUIRED_KEYS if prompt_key == GROUP_KEY else (prompt_key, rewards_key, done_key)
        self.required_keys = tuple(required_keys)
        self._selector_fields = selector_fields(self.candidate_selector)
        self.reserve_rows = reserve_rows

    # -- pickling: the proxy and the staging path travel; the manager object stays with its owner ----------------
    def __getstate__(self) -> dict:
        refuse_stdlib_spawn()
        state = super().__getstate__()
        state["_manager"] = None
        state["_owns_manager"] = False
        state["_owns_staging"] = False
        state["_lease"] = None  # each process takes its own
        return state

    # -- ownership: this process's lease ---------------------------------------------------------------------------
    def _owner(self) -> str:
        """This process's lease token (taken on first use, renewed by a heartbeat thread)."""
        lease = self.__dict__.get("_lease")
        if lease is None:
            with LEASE_LOCK:
                lease = self.__dict__.get("_lease")
                if lease is None:
                    lease = self.__dict__["_lease"] = ProcessLease(self._registry)
        return lease.token_now()

    def lease_token(self) -> str:
        """This process's lease token: what a service's coordinator knows this writer by."""
        return self._owner()

    def close(self) -> None:
        """Release this process's lease: the claims it took and did not confirm are handed to the next writer at
        once (not after the lease's time to live). The transform stays usable (a later call takes a new lease).
        Done at exit too."""
        lease = self.__dict__.get("_lease")
        if lease is not None:
            lease.release()

    @property
    def is_shared(self) -> bool:
        return True

    def share_memory_(self) -> SharedMCAdvantage:
        return self  # already shared: state lives in the manager

    def shutdown(self) -> None:
        """Release this process's lease; stop the manager and remove the temporary staging directory, if this
        transform made them."""
        self.close()
        if self._owns_manager and self._manager is not None:
            self._manager.shutdown()
            self._manager = None
        if self._owns_staging:
            import shutil

            shutil.rmtree(self.staging.path, ignore_errors=True)
            remove_at_exit(self.staging.path, remove=False)
            self._owns_staging = False

    # -- stats (same keys as torchrl) -----------------------------------------------------------------------------
    def get_stats(self) -> dict[str, float | int]:
        return call(self._registry, "get_stats")

    def _get_stat(self, name: str):
        if getattr(self, "_registry", None) is None:
            return self._stats[name]
        return self.get_stats()[name]

    def _set_stat(self, name: str, value) -> None:
        if getattr(self, "_registry", None) is None:
            self._stats[name] = value
        else:
            raise AttributeError(f"{name} is a shared counter; use reset_stats() to reset all of them")

    def reset_stats(self) -> None:
        if getattr(self, "_registry", None) is None:
            return super().reset_stats()
        call(self._registry, "reset_stats")

    def clear_queues(self) -> None:
        self.staging.delete(call(self._registry, "clear_queues"))

    def quarantined(self) -> list[dict]:
        """Groups that could not be written (records: commit id, group, handles, reason, rows); their payloads
        are under ``quarantine/<commit id>/`` of the staging directory."""
        return call(self._registry, "quarantined")

    def drop_reasons(self) -> dict[str, int]:
        """Groups dropped for rbpipe's own reasons (``quarantined``, ``nonfinite_advantage``, ``selector_error``,
        ``decision_error``); each is also counted in ``dropped_groups``."""
        return call(self._registry, "drop_reasons")

    @property
    def queued_groups(self) -> int:
        return int(self.get_stats()["queued_groups"])

    @property
    def queued_trajectories(self) -> int:
        return int(self.get_stats()["queued_trajectories"])

    @property
    def max_queued_trajectories_per_group(self) -> int:
        return int(self.get_stats()["max_queued_trajectories_per_group"])

    # -- splitting and validation (as MCAdvantage._inv_call, before anything is shared) --------------------------
    def split_trajectories(self, tensordict: TensorDictBase) -> list[TensorDictBase]:
        """Whole trajectories in ``tensordict`` (a [T] trajectory, several back to back, a [B, T] batch, or a list
        of these: trajectories of different lengths, e.g. one work unit's responses, handed over together)."""
        if isinstance(tensordict, (list, tuple)):
            return [t for part in tensordict for t in self.split_trajectories(part)]
        if not isinstance(tensordict, TensorDictBase):
            validate_trajectory(tensordict)  # raises the schema's clear message
        if tensordict.ndim == 0:
            tensordict = tensordict.unsqueeze(0)
        if tensordict.ndim > 2:
            tensordict = tensordict.flatten(0, -2)
        if tensordict.ndim == 2:
            return [t for traj in tensordict.unbind(0) for t in self.split_trajectories(traj)]
        done = tensordict.get(self.done_key, None)
        if not isinstance(done, torch.Tensor):
            validate_trajectory(tensordict, required=self.required_keys, reward_key=self.rewards_key,
                                done_key=self.done_key)
        done_np = numpy_view(done)  # numpy: a few elements, cheaper than a torch op's dispatch
        steps = tensordict.shape[0]
        step_done = (done_np.reshape(steps, -1).any(-1) if done_np is not None
                     else done.reshape(steps, -1).any(-1).cpu().numpy())
        if np.count_nonzero(step_done) > 1:
            ends = (np.flatnonzero(step_done) + 1).tolist()
            sizes = [b - a for a, b in zip([0] + ends[:-1], ends, strict=True)]
            if sum(sizes) < tensordict.shape[0]:
                sizes.append(tensordict.shape[0] - sum(sizes))
            return list(tensordict.split(sizes))
        return [tensordict]

    def _group_key(self, traj: TensorDictBase):
        group = traj.get(self.prompt_key, None)
        if isinstance(group, torch.Tensor) and not isinstance(group, TensorDictBase) and group.ndim:
            view = numpy_view(group)
            if view is not None:  # = traj[0][prompt_key], without a torch op
                first = view[0]
                return first.item() if first.size == 1 else tuple(first.reshape(-1).tolist())
            group = group[0]  # = traj[0][prompt_key] for a tensor leaf, without indexing the TensorDict
        else:
            group = traj[0][self.prompt_key]
        if isinstance(group, torch.Tensor):
            return group.item() if group.numel() == 1 else tuple(group.reshape(-1).tolist())
        if isinstance(group, str):
            return group
        raise BadTrajectoryError(f"group identifier {self.prompt_key!r} must be a string or a tensor, got "
                                 f"{type(group).__name__}")

    def prepare(self, tensordict: TensorDictBase, check=None) -> list[tuple[Any, TensorDictBase]]:
        """Split and validate everything first: a bad trajectory rejects the whole call, nothing queued.
        ``check``: one more test per trajectory (e.g. that it fits the storage), raising to reject."""
        trajs = self.split_trajectories(tensordict)
        out = []
        for traj in trajs:
            validate_trajectory(traj, required=self.required_keys, reward_key=self.rewards_key,
                                done_key=self.done_key)
            if check is not None:
                check(traj)
            out.append((self._group_key(traj), traj))
        return out

    # -- the write path ------------------------------------------------------------------------------------------
    def process(self, tensordict: TensorDictBase, check=None) -> Iterator[Claim]:
        """Queue every trajectory of ``tensordict``; yield the claims (completed groups) this process must write.

        Each yielded claim has its members loaded and advantages set; write them, then :meth:`confirm` (or
        :meth:`quarantine` one that cannot be written). ``check``: see :meth:`prepare`.
        """
        encoded = [(group, encode_td(traj), self._reward_message(traj))  # a leaf that cannot be staged
                   for group, traj in self.prepare(tensordict, check)]  # rejects the call before anything is queued
        handles: list[str] = []
        try:
            for _, data, _ in encoded:
                handles.append(self.staging.put(data))
        except BaseException:  # e.g. the disk is full: none of the call is handed over, none of it stays staged
            self.staging.delete(handles)
            raise
        items = [(group, handle, reward) for (group, _, reward), handle in zip(encoded, handles, strict=True)]
        # one round trip for the whole call (a collector's work unit), decided item by item in order
        owner = self._owner()
        decisions = call(self._registry, "append_many", items, owner, self.reserve_rows) if items else []
        for decision in decisions:
            if decision["recovered"]:
                yield from self._taken_over(decision["recovered"], owner)
            status = decision["status"]
            if status == "dropped":
                self.staging.delete(decision["handles"])
                if "message" in decision:
                    warnings.warn(decision["message"], RuntimeWarning, stacklevel=2)
            elif status == "write":
                try:
                    claim = self.load(decision, owner)
                except Exception as err:
                    if self.quarantine(self._bare_claim(decision, owner), err, warn=False) is None:
                        warn_lost(decision["group"], "its payloads could not be read")  # another writer's now
                        continue
                    raise
                yield claim

    def recover(self, *, force: bool = False) -> list[Claim]:
        """Claims of dead writers (``force``: of any other writer), loaded and ready to write + confirm."""
        owner = self._owner()
        return list(self._taken_over(call(self._registry, "recover", owner, force), owner))

    def _taken_over(self, decisions: list[dict], owner: str | None = None) -> Iterator[Claim]:
        """Claims taken over from writers that died: those the registry quarantined, and those whose payloads
        cannot be read, are set aside (with a warning); the others are loaded."""
        for decision in decisions:
            record = decision.get("quarantine")
            if record is not None:
                self._set_aside(self._bare_claim(decision), record)
                continue
            try:
                claim = self.load(decision, owner)
            except Exception as err:  # noqa: BLE001 - a poison claim must not kill the writer that took it over
                if self.quarantine(self._bare_claim(decision, owner), err) is None:
                    warn_lost(decision["group"], "its payloads could not be read")
                continue
            claim.recovered = True
            yield claim

    def _reward_message(self, traj: TensorDictBase) -> tuple:
        """What the manager decides on: the reward tensor's ``(bytes, dtype, shape)``, plus the step count when
        per-token rewards of varying length were flattened (``schema.flat_reward``), plus the fields a custom
        selector declared (``((key parts), encoded tensor)`` pairs), in the one call per trajectory."""
        reward, steps = flat_reward(traj, self.rewards_key)
        message = encode_tensor(reward)
        if self._selector_fields:
            return (*message, steps, self._fields_of(traj, steps or reward.shape[0]))
        return message if steps is None else (*message, steps)

    def _fields_of(self, traj: TensorDictBase, steps: int) -> tuple:
        out = []
        for key in self._selector_fields:
            try:
                value = traj.get(key, None)
            except RuntimeError:  # steps of different shapes
                value = None
            if not (isinstance(value, torch.Tensor) and not value.is_nested and value.ndim
                    and value.shape[0] == steps):
                raise BadTrajectoryError(
                    f"candidate_selector reads ('trajectories', {'.'.join(key)!r}): every trajectory must carry it "
                    f"as a tensor with one row per step ({steps}), got {type(value).__name__} "
                    f"{tuple(getattr(value, 'shape', ()))}")
            out.append((key, encode_tensor(value)))
        return tuple(out)

    @staticmethod
    def _bare_claim(decision: dict, owner: str | None = None) -> Claim:
        return Claim(decision["commit_id"], decision["group"], list(decision["selected"]),
                     list(decision["advantages"]), list(decision["unselected"]), decision.get("rows"), owner=owner)

    def quarantine(self, claim: Claim, error: BaseException | str, *, warn: bool = True) -> dict | None:
        """``claim`` cannot be written: drop it with reason ``quarantined`` (counted, recorded, never handed to
        another writer) and move its payloads to ``quarantine/<commit id>/``; returns its record. ``warn``:
        say so (a caller that raises about it instead passes False)."""
        reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        args = (claim.commit_id, reason) if claim.owner is None else (claim.commit_id, reason, claim.owner)
        record = call(self._registry, "quarantine", *args)
        if record is not None:
            self._set_aside(claim, record, warn)
        return record

    def _set_aside(self, claim: Claim, record: dict, warn: bool = True) -> None:
        where = self.staging.quarantine(claim.commit_id, claim.handles, record)
        if warn:
            warnings.warn(f"group {claim.group!r} could not be written and was quarantined (counted as dropped, "
                          f"reason 'quarantined'): {record['reason']}. Its payloads and reason are in {where}",
                          RuntimeWarning, stacklevel=3)

    def load(self, decision: dict, owner: str | None = None) -> Claim:
        claim = self._bare_claim(decision, owner)
        payloads = [decode_leaves(self.staging.read(handle)) for handle in claim.selected]
        self._assemble(claim, payloads)
        if claim.assembled is None:
            claim._build_members = lambda: self._members_of(payloads, claim.advantages)
            if claim.jagged is None:
                claim.members  # noqa: B018 - built now: a bad payload fails in load, not later
        return claim

    def _members_of(self, payloads: list, advantages: list) -> list[TensorDictBase]:
        members = []
        for payload, adv in zip(payloads, advantages, strict=True):
            traj = td_from_leaves(*payload)
            reward = leaf_steps(traj, self.rewards_key)
            if isinstance(reward, list):  # per-token rewards: each step gets its tokens' advantages
                parts = decode_tensor(*adv).reshape(-1).split([r.numel() for r in reward])
                for row, r, a in zip(traj.unbind(0), reward, parts, strict=True):
                    row.set(self.advantage_key, a.reshape(r.shape))
            else:
                traj.set(self.advantage_key, decode_tensor(*adv).reshape(reward.shape))
            members.append(traj)
        return members

    def _assemble(self, claim: Claim, payloads: list) -> None:
        """Concatenate all-tensor members of one layout leaf by leaf from the staged bytes (one decode per
        leaf, no TensorDict per member). Sets ``claim.assembled`` when every leaf concatenates densely (what
        ``group_of`` would return), or ``claim.jagged`` when the members are one-step trajectories whose 2-D
        leaves differ in length (LLM tokens and log-probs: ``[n, j]`` jagged leaves, which rbpipe stores write
        as cheaply as dense ones, where torchrl's lazy stack of members costs a walk over every member; not
        built for torchrl storages, ``reserve_rows``). Neither when the members need torchrl's general path."""
        if not payloads:
            return
        batch0, leaves0 = payloads[0]
        sizes = []
        for batch_size, leaves in payloads:
            if len(batch_size) != 1 or len(leaves) != len(leaves0):
                return
            sizes.append(batch_size[0])
        may_be_jagged = not self.reserve_rows and all(size == 1 for size in sizes)
        kinds = []  # per leaf: True = jagged, False = dense; checked for every leaf before anything is decoded
        for i, (key, dtype, shape0, _) in enumerate(leaves0):
            same = True
            for (_, leaves), size in zip(payloads, sizes, strict=True):
                k, dt, shape, _ = leaves[i]
                if dt not in PLAIN or k != key or dt != dtype or len(shape) != len(shape0) or shape[0] != size:
                    return
                same = same and shape[1:] == shape0[1:]
            if not same and not (may_be_jagged and len(shape0) == 2):
                return
            kinds.append(not same)
        group = concat_leaves(payloads, kinds, sum(sizes), decode_tensor)  # rbpipe.members: the column layout
        reward = group.get(self.rewards_key, None)
        if reward is None or reward.is_nested:
            return
        advs = [decode_tensor(*adv).reshape(size, *reward.shape[1:])
                for adv, size in zip(claim.advantages, sizes, strict=True)]
        group.set(self.advantage_key, advs[0] if len(advs) == 1 else torch.cat(advs, 0))
        if any(kinds):
            claim.jagged = group
        else:
            claim.assembled, claim._sizes = group, sizes

    def group_of(self, claim: Claim, *, jagged: bool = False) -> TensorDictBase:
        """The claim's members concatenated like torchrl does (contiguous when possible, else lazily); with
        ``jagged``, members of varying lengths come as one TensorDict of jagged leaves where possible (what
        rbpipe stores take, and the cheapest form for them to write)."""
        if claim.assembled is not None:
            return claim.assembled
        if jagged and claim.jagged is not None:
            return claim.jagged
        return self._cat_tensordicts(claim.members, -1)

    def confirm(self, claim: Claim) -> bool:
        """The group is in storage: count it as written and delete its staged payloads. False (with a
        :class:`ClaimLostWarning`) when the claim is no longer this process's: see :meth:`confirm_many`."""
        return bool(self.confirm_many([claim]))

    def confirm_many(self, claims: list[Claim]) -> list[Claim]:
        """:meth:`confirm` the groups one hand-over wrote, in one round trip to the manager; returns those
        confirmed. A claim whose lease this process lost (it did not renew it for the lease's time to live:
        frozen, stalled) and that another writer took over is refused, with a :class:`ClaimLostWarning`: that
        writer writes and confirms it, and its staged payloads are left to it. (An rbpipe store absorbs the
        late write: the claim carries its commit id.)"""
        by_owner: dict[str | None, list[Claim]] = {}
        for claim in claims:
            by_owner.setdefault(claim.owner, []).append(claim)
        confirmed: list[Claim] = []
        for owner, own in by_owner.items():  # one round trip, but for a lease renewed in between
            ids = [claim.commit_id for claim in own]
            answers = call(self._registry, "confirm_many", ids) if owner is None else \
                call(self._registry, "confirm_many", ids, owner)
            for claim, ok in zip(own, answers, strict=True):
                if ok or owner is None:  # without an owner: as before, idempotent
                    confirmed.append(claim)
                else:
                    warn_lost(claim.group, "it was not confirmed here")
        self.staging.delete([handle for claim in confirmed for handle in claim.handles])
        return confirmed

    def confirm_stored(self, committed: AbstractSet[str]) -> int:
        """Confirm every claim whose members are all in ``committed`` (the store's committed member ids): a
        writer killed after storing groups and before confirming them left them claimed, their members counted
        as queued although they are stored. Deletes every staged payload in ``committed``. Call it once the
        writers are gone (a service at its end). Returns how many were confirmed."""
        stored = [(cid, handles) for cid, handles in call(self._registry, "unconfirmed")
                  if handles and all(handle in committed for handle in handles)]
        if stored:
            call(self._registry, "confirm_many", [cid for cid, _ in stored])
            self.staging.delete([handle for _, handles in stored for handle in handles])
        # and the payloads of groups stored *and* confirmed by a writer killed before it deleted them: no claim
        # names them any more, and nothing else would remove them (a resume would, with requeue_staged)
        self.staging.delete([handle for handle in self.staging.handles() if handle in committed])
        return len(stored)

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase | None:
        """Stand-alone use (no rbpipe buffer): return completed groups, counted as written once returned. A group
        is returned only once its confirmation succeeded: a claim this process lost to another writer (its lease
        expired) is that writer's to return, never both's."""
        claims = list(self.process(tensordict))
        built = {claim.commit_id: self.group_of(claim) for claim in claims}  # before confirm deletes the payloads
        groups = [built[claim.commit_id] for claim in self.confirm_many(claims)]
        if not groups:
            return None
        return groups[0] if len(groups) == 1 else self._cat_tensordicts(groups, 0)

    # -- recovery: the one path (a resumed service requeues what is staged on disk) ------------------------------
    def requeue_staged(self, skip: AbstractSet[str] = frozenset()) -> tuple[list[Claim], int, int, dict]:
        """After a crash: hand every trajectory still staged on disk to the registry again.

        A staged payload was handed over and is neither written nor dropped yet (writers delete payloads
        after the commit or the drop), so the manager's lost queues are rebuilt from the disk. Each goes
        through the normal decision path, so groups it completes are claimed: returns ``(claims to write,
        requeued, torn, {group: trajectories requeued})``. Call on a fresh registry before writers start. A
        payload cut short by a kill mid-write was never queued: it is renamed ``*.torn`` and counted, not
        served. Handles in ``skip`` (members of groups the store already committed: the writer died before
        deleting them) are deleted.
        """
        claims: list[Claim] = []
        self.staging.sweep()  # recycled (never read) files of processes that are gone
        self.staging.delete([h for h in self.staging.handles() if h in skip])
        requeued = torn = 0
        by_group: dict = {}
        paths = sorted((self.staging.path / h for h in self.staging.handles()), key=lambda p: p.stat().st_mtime_ns)
        for path in paths:
            handle = path.relative_to(self.staging.path).as_posix()
            try:
                traj = self.staging.load(handle)
                group = self._group_key(traj)
                reward = self._reward_message(traj)
            except Exception:  # noqa: BLE001 - a torn or foreign file
                os.replace(path, path.with_name(path.name + ".torn"))
                torn += 1
                continue
            owner = self._owner()
            decision = call(self._registry, "append", group, handle, reward, owner, self.reserve_rows)
            requeued += 1
            by_group[group] = by_group.get(group, 0) + 1
            claims.extend(self._taken_over(decision["recovered"], owner))
            if decision["status"] == "dropped":
                self.staging.delete(decision["handles"])
            elif decision["status"] == "write":
                claims.append(self.load(decision, owner))
        return claims, requeued, torn, by_group


__all__ = ["QUEUE_STATS", "STAT_NAMES", "Claim", "ClaimLostWarning", "SharedMCAdvantage"]
