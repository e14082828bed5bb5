"""``FreshGroupSampler``: the learner's torchrl ``Sampler`` over whole committed groups.

GRPO needs every member of a group in the same batch (the advantages are relative to the group), wants
each group trained on once (on-policy), and must skip groups sampled by a policy that is too old. torchrl's
``PromptGroupSampler`` replays groups forever and rebuilds its index from ``storage[:]``; this sampler reads
the storage's group spans (one cheap call) and each fresh group's oldest ``policy_version`` once (from its
commit record when the store keeps it there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torchrl.data.replay_buffers.samplers import Sampler
from torchrl.data.replay_buffers.storages import Storage

from rbpipe.errors import StaleReadError
from rbpipe.sampling.staleness import check_sample_order, freshest_first
from rbpipe.storage.protocol import is_group_store
from rbpipe.trajectory import VERSION_KEY

REDRAWS = 8  # draws tried when the drawn groups keep being evicted before they are read


class FreshGroupSampler(Sampler):
    """Draw ``num_groups`` whole, unconsumed, fresh groups (oldest first, or freshest first).

    Keyword Args:
        num_groups: groups per batch; ``batch_size`` passed to ``sample`` is ignored in favour of whole groups.
        consume: when True (default) a group is returned at most once.
        max_staleness: a group whose *oldest* member was sampled with policy version
            ``< consumer_version - max_staleness`` is skipped for good and counted in ``stale_groups``.
            ``None`` disables the limit.
        version_key: column holding each trajectory's policy version.
        order: ``"oldest"`` (commit order) or ``"freshest"`` (the newest oldest-member policy version first,
            commit order among equals; :func:`rbpipe.sampling.staleness.freshest_first`), when consuming.
    """

    def __init__(self, *, num_groups: int, consume: bool = True, max_staleness: int | None = None,
                 version_key=VERSION_KEY, order: str = "oldest") -> None:
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.num_groups = int(num_groups)
        self.consume = consume
        self.max_staleness = max_staleness
        self.version_key = version_key
        check_sample_order(order)
        self.order = order
        self.consumer_version = 0
        self._watermark = 0  # every group whose commit sequence number is below this is consumed or retired
        self._done: set[int] = set()  # sequence numbers consumed/retired past the watermark
        self._oldest: dict[int, int] = {}  # sequence number -> oldest policy version, of groups past the watermark
        self._rng = None
        self.consumed_groups = 0
        self.stale_groups = 0
        self.stale_trajectories = 0

    # -- what is available -------------------------------------------------------------------------------------
    def _fresh_spans(self, storage: Storage) -> tuple[torch.Tensor, list[int]]:
        """Spans still to be trained on, oldest first, and the sequence numbers of every live group, both from
        one ``group_spans()`` (one numbering: the rows a draw hands out are read under it). Stale ones are
        retired (and counted) on sight.

        Staleness only grows (``consumer_version`` never decreases), so a group found stale stays stale.
        """
        for _ in range(REDRAWS):
            try:
                return self._fresh_spans_once(storage)
            except StaleReadError:  # the versions' groups were evicted under us: look again
                continue
        return self._fresh_spans_once(storage)

    def _fresh_spans_once(self, storage: Storage) -> tuple[torch.Tensor, list[int]]:
        spans = storage.group_spans()
        live = spans[:, 0].tolist()
        spans = spans[spans[:, 0] >= self._watermark]
        if spans.numel() == 0:
            return spans.reshape(0, 3), live
        todo = torch.tensor([int(s) not in self._done for s in spans[:, 0].tolist()], dtype=torch.bool)
        spans = spans[todo]
        if self.max_staleness is not None and spans.shape[0]:
            oldest = self._oldest_versions(storage, spans)
            stale = oldest < self.consumer_version - self.max_staleness
            if self.consume:
                lengths = spans[:, 2] - spans[:, 1]
                for seq, length in zip(spans[stale, 0].tolist(), lengths[stale].tolist(), strict=True):
                    self._done.add(int(seq))
                    self.stale_groups += 1
                    self.stale_trajectories += int(length)
                self._advance_watermark(live)
            spans = spans[~stale]
        return spans, live

    def _oldest_versions(self, storage: Storage, spans: torch.Tensor) -> torch.Tensor:
        """Each span's oldest policy version. A committed group never changes, so each is found once: from its
        commit record where the store keeps it there (``group_minimums``), else by reading its column (a
        learner that waits checks every few milliseconds; reading every fresh group's column each time cost
        a visible part of each check and step; figures: docs/DESIGN.md, Figures behind code choices)."""
        seqs = [int(seq) for seq in spans[:, 0].tolist()]
        new = [seq for seq in seqs if seq not in self._oldest]
        if new:
            if is_group_store(storage):
                self._oldest.update(storage.group_minimums(self.version_key, new))
            unread = [i for i, seq in enumerate(seqs) if seq not in self._oldest]
            if unread:
                self._read_oldest(storage, spans[unread])
            if len(self._oldest) > 2 * len(seqs) + 64:  # evicted or (consume=False) long-passed groups
                live = set(seqs)
                self._oldest = {seq: v for seq, v in self._oldest.items() if seq in live}
        return torch.tensor([self._oldest[seq] for seq in seqs], dtype=torch.int64)

    def _read_oldest(self, storage: Storage, fresh: torch.Tensor) -> None:
        lengths = fresh[:, 2] - fresh[:, 1]
        rows = torch.cat([torch.arange(int(a), int(b)) for a, b in fresh[:, 1:].tolist()])
        versions = storage.read_column(self.version_key, rows).reshape(-1)
        group_of_row = torch.repeat_interleave(torch.arange(fresh.shape[0]), lengths)
        oldest = torch.full((fresh.shape[0],), torch.iinfo(torch.int64).max, dtype=torch.int64)
        oldest = oldest.scatter_reduce(0, group_of_row, versions.long(), reduce="amin")
        self._oldest.update(zip(fresh[:, 0].tolist(), oldest.tolist(), strict=True))

    def _advance_watermark(self, live: list[int]) -> None:
        """Move the watermark past the consumed or retired groups at the head of ``live`` (the sequence numbers
        of the draw's ``group_spans()``: reading them again here would renumber the rows just drawn)."""
        for seq in live:
            if seq < self._watermark:
                continue
            if int(seq) not in self._done:
                break
            self._done.discard(int(seq))
            self._oldest.pop(int(seq), None)
            self._watermark = int(seq) + 1

    def available_groups(self, storage: Storage) -> int:
        return int(self._fresh_spans(storage)[0].shape[0])

    def can_sample(self, storage: Storage, batch_size: int | None = None) -> bool:
        return self.available_groups(storage) >= self.num_groups

    def sample(self, storage: Storage, batch_size: int | None = None) -> tuple[torch.Tensor, dict]:
        """Draw, then have the storage hold the draw (``hold``): the buffer's ``storage.get(index)`` that
        follows then reads exactly the drawn groups, under the numbering they were drawn from, whatever is
        evicted or renumbered meanwhile. Groups whose files were deleted between the draw and the hold make it
        raise :class:`StaleReadError`: draw again."""
        for _ in range(REDRAWS):
            chosen, live = self._draw(storage)
            index = torch.cat([torch.arange(int(s), int(e)) for _, s, e in chosen.tolist()])
            try:
                if is_group_store(storage) and storage.holds_reads:
                    storage.hold(index, group_seqs=chosen[:, 0].tolist())
            except StaleReadError:
                continue  # nothing was consumed yet
            if self.consume:
                self._done.update(int(s) for s in chosen[:, 0].tolist())
                self.consumed_groups += self.num_groups
                self._advance_watermark(live)
            return index, {"group_seq": chosen[:, 0].clone(), "group_spans": chosen.clone()}
        raise StaleReadError(f"the groups drawn were evicted before they could be read, {REDRAWS} times in a row: "
                             "retention evicts faster than this learner samples; raise max_size")

    def _draw(self, storage: Storage) -> tuple[torch.Tensor, list[int]]:
        """The spans of ``num_groups`` fresh groups, the oldest (consume) or random ones, and the sequence
        numbers of the live groups they were drawn among."""
        fresh, live = self._fresh_spans(storage)
        if fresh.shape[0] < self.num_groups:
            raise RuntimeError(
                f"only {fresh.shape[0]} fresh group(s) available, {self.num_groups} needed; "
                "check can_sample() first or wait for the collectors"
            )
        if self.consume and self.order == "freshest":
            return fresh[freshest_first(self._oldest_versions(storage, fresh))[: self.num_groups]], live
        if self.consume:
            return fresh[: self.num_groups], live
        return fresh[torch.randperm(fresh.shape[0], generator=self._rng)[: self.num_groups]], live

    # -- torchrl Sampler plumbing ------------------------------------------------------------------------------
    def _empty(self) -> None:
        self._watermark = 0
        self._done.clear()
        self._oldest.clear()
        self.consumed_groups = self.stale_groups = self.stale_trajectories = 0

    def state_dict(self) -> dict[str, Any]:
        return {"watermark": self._watermark, "done": sorted(self._done), "consumer_version": self.consumer_version,
                "consumed_groups": self.consumed_groups, "stale_groups": self.stale_groups,
                "stale_trajectories": self.stale_trajectories}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._watermark = int(state_dict["watermark"])
        self._done = set(int(s) for s in state_dict["done"])
        self.consumer_version = int(state_dict["consumer_version"])
        self.consumed_groups = int(state_dict["consumed_groups"])
        self.stale_groups = int(state_dict["stale_groups"])
        self.stale_trajectories = int(state_dict["stale_trajectories"])

    def dumps(self, path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "sampler_state.json").write_text(json.dumps(self.state_dict()))

    def loads(self, path) -> None:
        self.load_state_dict(json.loads((Path(path) / "sampler_state.json").read_text()))
