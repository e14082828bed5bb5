"""``GroupReplayBuffer``: a torchrl ``ReplayBuffer`` whose writes go through the shared grouping transform.

``grouping="rbpipe"``: ``extend``/``add`` run :class:`~rbpipe.grouping.SharedMCAdvantage`; each completed
group is written by the writer that completed it, outside any lock (``storage.append_group`` with the
claim's commit id where the storage has it, e.g. ``ArrowStorage``; for torchrl tensor storages into a
row range reserved by the manager), then confirmed (the groups of one call in one round trip). No lock lives
in the buffer, so it pickles into ``multiprocess`` spawn children.

``grouping="torchrl"``: torchrl's stock shared ``MCAdvantage`` (stdlib manager, one RLock) behind the stock
``ReplayBuffer`` write path; the baseline. It also works across ``multiprocess`` spawn workers: when the
buffer is pickled for a spawn child, :mod:`rbpipe.grouping.bridge` pickles it with stdlib's spawning hook
set (so the write ``Lock``, the storage's length ``Value`` and the manager proxies travel) and installs the
parent's stdlib authkey in the child before the proxies reconnect.

A group that cannot be written is quarantined (see :mod:`rbpipe.grouping.registry`): a writer that fails on a
group it took over from a dead writer warns and goes on; one that fails on its own group raises
:class:`GroupWriteError` after writing the others. A trajectory that does not fit a torchrl tensor storage
(other keys, dtypes or trailing shapes than the allocated layout) is refused before it is handed over, so no
group ever reserves rows it cannot fill: torchrl would silently write part of it (keys it lacks stay
uninitialised memory inside ``len(storage)``, extra keys are lost, dtypes are cast).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.data import ReplayBuffer
from torchrl.objectives.llm import MCAdvantage

from rbpipe.errors import BadTrajectoryError, ConfigError, StoreError
from rbpipe.grouping import SharedMCAdvantage, bridged_reduce, connect_manager, start_manager
from rbpipe.grouping.bridge import spawning
from rbpipe.storage.collate import collate_identity
from rbpipe.storage.protocol import is_group_store
from rbpipe.trajectory import GROUP_KEY

__all__ = ["GroupReplayBuffer", "GroupWriteError", "make_replay_buffer", "allocate_storage", "start_manager",
           "connect_manager"]


class GroupWriteError(StoreError):
    """A group this writer completed could not be written; it was quarantined (not handed to another writer)."""


class _Bridging(threading.local):
    active = False


_BRIDGING = _Bridging()


class GroupReplayBuffer(ReplayBuffer):
    """Replay buffer that persists whole groups; see the module docstring for the two groupings."""

    def __init__(self, *, storage, transform, grouping: str = "rbpipe", **kwargs) -> None:
        self.grouping = grouping
        self._made_in = os.getpid()  # a forked child has the same object: only its pid tells it is a copy
        super().__init__(storage=storage, transform=transform, shared=(grouping == "torchrl"), **kwargs)

    @property
    def grouping_transform(self):
        return self._transform[0] if self._transform is not None and len(self._transform) else None

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._unpickled = True  # a copy in another process: never allocate a lazy storage privately

    def __reduce_ex__(self, protocol):
        if spawning() and not _BRIDGING.active:
            _BRIDGING.active = True
            try:
                return bridged_reduce(self)  # pickles self again below, the plain way, with stdlib sharing on
            finally:
                _BRIDGING.active = False
        return super().__reduce_ex__(protocol)

    # -- rbpipe write path ---------------------------------------------------------------------------------------
    def extend(self, data, *, update_priority=None) -> torch.Tensor:
        if self.grouping != "rbpipe":
            return super().extend(data, update_priority=update_priority)
        self._refuse_private_allocation()
        outcomes = self._write_all(self.grouping_transform.process(data, self._fit_check()))
        failed = [claim for claim, index in outcomes if index is None and not claim.recovered]
        if failed:
            raise GroupWriteError(f"{len(failed)} group(s) completed here could not be written and were "
                                  f"quarantined (e.g. group {failed[0].group!r}): {failed[0].error}. See "
                                  "transform.quarantined()") from failed[0].error
        indices = [index for _, index in outcomes if index is not None]
        if not indices:
            return torch.zeros((0,), dtype=torch.long)
        return torch.cat(indices)

    def _write_all(self, claims) -> list[tuple[Any, torch.Tensor | None]]:
        """Write each claim (quarantining one that fails: index None), then confirm the written ones in one round
        trip to the manager, also when a later claim raised."""
        outcomes: list[tuple[Any, torch.Tensor | None]] = []
        try:
            for claim in claims:
                outcomes.append((claim, self._write_or_quarantine(claim)))
        finally:
            self.grouping_transform.confirm_many([claim for claim, index in outcomes if index is not None])
        return outcomes

    def _write_or_quarantine(self, claim) -> torch.Tensor | None:
        """Write ``claim`` (the caller confirms it); a write that fails quarantines it (None)."""
        try:
            return self._write_claim(claim)
        except Exception as err:  # noqa: BLE001 - whatever it is, the group must not be handed on
            claim.error = err
            self._blank_rows(claim)
            self.grouping_transform.quarantine(claim, err, warn=claim.recovered)  # an own group raises instead
            return None

    def _blank_rows(self, claim) -> None:
        """A write into reserved rows failed after the trajectories passed :meth:`_fit_check` (rare: the storage
        itself failed): zero the rows, so a later group's length never exposes uninitialised memory (NaNs)
        there. Until the registry gives the range to the next group of that size, they are inside
        ``len(storage)`` as zeros (zero advantage); the quarantine record keeps the range."""
        storage = self._storage
        if claim.rows is None or is_group_store(storage) or not getattr(storage, "initialized", False):
            return
        end = min(claim.rows + sum(int(shape[0]) for *_, shape in claim.advantages), storage.max_size)
        if end > claim.rows:
            with contextlib.suppress(Exception):  # best effort: the quarantine record names the rows
                storage._storage[claim.rows:end].zero_()

    def _is_copy(self) -> bool:
        """This process holds a copy of the buffer (spawned: unpickled; forked: another pid)."""
        return getattr(self, "_unpickled", False) or os.getpid() != getattr(self, "_made_in", os.getpid())

    def _refuse_private_allocation(self) -> None:
        """In a copy of the buffer (a writer process), a torchrl storage must be one the parent sees: a lazy one
        not allocated yet would be allocated here alone, and one in this process's private memory (a forked
        child's copy-on-write pages) would take the writes; either way the parent's stays empty, silently.
        Refused before anything is handed over."""
        storage = self._storage
        pid = os.getpid()
        if getattr(self, "_storage_checked_in", None) == pid or is_group_store(storage) or not self._is_copy():
            return
        name = type(storage).__name__
        if not getattr(storage, "initialized", True):
            raise ConfigError(f"this process (pid {pid}) holds a copy of the replay buffer whose torchrl storage "
                              f"({name}) is not allocated yet: allocated here, it would be this process's alone and "
                              "the parent's would stay empty. Allocate it in the parent before starting writers "
                              "(rbpipe.buffer.allocate_storage(storage, example), or write one group), or use an "
                              "rbpipe store (ArrowStorage, ZarrStorage)")
        data = getattr(storage, "_storage", None)
        if isinstance(data, TensorDictBase) and not (data.is_shared() or data.is_memmap()):
            raise ConfigError(f"this process (pid {pid}) holds a forked copy of the replay buffer whose torchrl "
                              f"storage ({name}) is in the parent's private memory: its writes would land in this "
                              "process's copy and the parent's would stay empty. Use LazyMemmapStorage, or move the "
                              "storage to shared memory in the parent (storage._storage.share_memory_()) before "
                              "forking writers, or use an rbpipe store (ArrowStorage, ZarrStorage)")
        self._storage_checked_in = pid

    def _fit_check(self):
        """For a torchrl tensor storage already allocated: a per-trajectory check against its layout."""
        storage = self._storage
        if is_group_store(storage) or not getattr(storage, "initialized", False):
            return None
        layout = getattr(self, "_layout", None)
        if layout is None:
            advantage = self.grouping_transform.advantage_key
            layout = self._layout = {key: (leaf.dtype, tuple(leaf.shape[1:]))
                                     for key, leaf in storage._storage.items(True, True)
                                     if isinstance(leaf, torch.Tensor) and key != advantage}
        return lambda traj: _check_fits(traj, layout)

    def requeue_staged(self) -> tuple[int, int, dict]:
        """Queue again what a previous session left staged, writing any group it completes: ``(requeued, torn,
        {group: trajectories requeued})``."""
        committed = self._storage.committed_member_ids() if is_group_store(self._storage) else set()
        claims, requeued, torn, by_group = self.grouping_transform.requeue_staged(skip=committed)
        for claim in claims:
            claim.recovered = True  # a previous session's group: quarantined with a warning if it fails
        self._write_all(claims)
        return requeued, torn, by_group

    def confirm_stored(self) -> int:
        """Confirm the groups that writers stored and were killed before confirming (see
        :meth:`SharedMCAdvantage.confirm_stored`): the service does it once its workers are gone, so the run's
        summary counts them as written, not queued. Stores without commit ids (torchrl's) have none."""
        if self.grouping != "rbpipe" or not is_group_store(self._storage):
            return 0
        return self.grouping_transform.confirm_stored(self._storage.committed_member_ids())

    def add(self, data) -> torch.Tensor:
        if self.grouping != "rbpipe":
            return super().add(data)
        return self.extend(data.unsqueeze(0) if data.ndim == 0 else data)

    def recover(self, *, force: bool = False) -> int:
        """Write and confirm groups claimed by writers that died before confirming; returns how many."""
        return sum(index is not None for _, index in self._write_all(self.grouping_transform.recover(force=force)))

    def _write_claim(self, claim) -> torch.Tensor:
        """Write one claim's group into the storage (not confirmed: see :meth:`_write_all`)."""
        transform = self.grouping_transform
        storage = self._storage
        if is_group_store(storage):
            group = transform.group_of(claim, jagged=storage.accepts_jagged)
            if storage.idempotent_commits:  # a recovered claim already committed is not rewritten
                index = storage.append_group(group, commit_id=claim.commit_id, member_ids=claim.handles)
            else:
                index = storage.append_group(group)
        else:
            group = transform.group_of(claim)
            if claim.rows is None:
                raise ConfigError("this storage has no append_group: build the buffer with make_replay_buffer "
                                  "so the grouping reserves row ranges for it")
            n = group.shape[0]
            index = torch.arange(claim.rows, claim.rows + n)
            if claim.rows + n > storage.max_size:
                raise StoreError(f"the storage is full ({storage.max_size} rows): allocate a larger one")
            if not storage.initialized and not self._is_copy():
                allocate_storage(storage, group)
            if not storage.initialized:
                raise ConfigError("allocate the torchrl storage in the parent before starting writers "
                                  "(write one group or use LazyTensorStorage(shared_init=True))")
            storage.set(index, group, set_cursor=False)
            _raise_len(storage, claim.rows + n)
        self._sampler.extend(index)
        return index


def _check_fits(traj, layout: dict) -> None:
    """Refuse a trajectory whose tensor leaves differ from the storage's (keys, dtypes, trailing shapes)."""
    problems = []
    seen = set()
    for key, leaf in traj.items(True, True):
        if not isinstance(leaf, torch.Tensor):
            continue
        seen.add(key)
        want = layout.get(key)
        if want is None:
            problems.append(f"{key!r} is not in the storage")
        elif leaf.dtype != want[0] or tuple(leaf.shape[1:]) != want[1]:
            problems.append(f"{key!r} is {leaf.dtype} {tuple(leaf.shape[1:])}, the storage holds {want[0]} {want[1]}")
    problems.extend(f"{key!r} is missing (the storage has it)" for key in layout if key not in seen)
    if problems:
        raise BadTrajectoryError("trajectory does not fit the torchrl storage (allocated from the first group; "
                                 "a torchrl tensor storage keeps one layout): " + "; ".join(problems[:4]))


def allocate_storage(storage, example) -> None:
    """Allocate a lazy torchrl tensor storage from one example row, in the parent, before writers start."""
    if getattr(storage, "initialized", True):
        return
    row = example[0] if example.ndim else example
    storage._init(row.exclude(*[k for k in row.keys(True, True) if k not in example.keys(True, True)]))


def _raise_len(storage, length: int) -> None:
    """Grow a torchrl tensor storage's (shared) length to ``length`` (never shrink it)."""
    value: Any = getattr(storage, "_len_value", None)
    lock = value.get_lock() if hasattr(value, "get_lock") else contextlib.nullcontext()
    with lock:
        storage._len = max(storage._len, length)


def make_replay_buffer(storage, *, grouping: str = "rbpipe", grpo_size: int, manager=None, staging_dir=None,
                       sampler=None, batch_size=None, writer=None, collate_fn=None,
                       **mcadvantage_kwargs: Any) -> GroupReplayBuffer:
    """Build the shared GRPO buffer over ``storage`` (torchrl ``Storage``; ``ArrowStorage`` preferred).

    ``mcadvantage_kwargs`` are ``MCAdvantage``'s options (``prompt_key`` defaults to the schema's group id).
    ``grouping="rbpipe"`` uses ``manager`` (``start_manager()``; one is started when None) and stages payloads
    in ``staging_dir``; ``grouping="torchrl"`` is the stock shared ``MCAdvantage`` baseline.
    """
    mcadvantage_kwargs.setdefault("prompt_key", GROUP_KEY)
    for key in ("candidate_group_size", "candidate_selection_min_size", "candidate_selector"):
        if mcadvantage_kwargs.get(key, 0) is None:
            mcadvantage_kwargs.pop(key)
    group_store = is_group_store(storage)
    if writer is None and group_store:
        from rbpipe.storage import GroupWriter

        writer = GroupWriter()
    if collate_fn is None and group_store:
        collate_fn = collate_identity  # group storages return ready TensorDicts
    extra = {k: v for k, v in dict(sampler=sampler, batch_size=batch_size, writer=writer,
                                   collate_fn=collate_fn).items() if v is not None}
    if grouping == "rbpipe":
        transform = SharedMCAdvantage(grpo_size, manager=manager, staging_dir=staging_dir,
                                      reserve_rows=not group_store, **mcadvantage_kwargs)
    elif grouping == "torchrl":
        mcadvantage_kwargs.pop("required_keys", None)
        transform = MCAdvantage(grpo_size, **mcadvantage_kwargs)
    else:
        raise ConfigError(f"grouping must be 'rbpipe' or 'torchrl', got {grouping!r}")
    return GroupReplayBuffer(storage=storage, transform=transform, grouping=grouping, **extra)
