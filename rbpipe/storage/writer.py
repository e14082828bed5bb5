"""``GroupWriter``: a torchrl ``Writer`` whose every ``add``/``extend`` commits one whole group."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.data.replay_buffers.writers import Writer

from rbpipe.errors import StoreError
from rbpipe.storage.protocol import is_group_store


class GroupWriter(Writer):
    """Hands each write to ``storage.append_group`` (one atomic commit per call); no cursor to keep.

    The storage decides row positions (commit order across processes), so the writer is stateless
    and safe to pickle into any number of writer processes. It is the writer a ``ReplayBuffer`` over
    ``ArrowStorage``/``ZarrStorage`` needs (``rbpipe.storage.group_buffer`` sets it): torchrl's default
    ``RoundRobinWriter`` keeps its own cursor and cycles through row positions, which an append-only store
    refuses (a ``StoreError``) as soon as the cursor and the store's end differ: at its wrap-around, after an
    eviction, or once another process has appended.
    """

    def __init__(self) -> None:
        super().__init__()

    def _check(self):
        if not is_group_store(self._storage):
            raise StoreError(f"GroupWriter needs an ArrowStorage or ZarrStorage, got "
                             f"{type(self._storage).__name__}")

    def add(self, data: Any) -> torch.Tensor:
        self._check()
        if isinstance(data, TensorDictBase) and data.ndim == 0:
            data = data.unsqueeze(0)
        return self._storage.append_group(data)

    def extend(self, data: Any) -> torch.Tensor:
        self._check()
        return self._storage.append_group(data)

    def _empty(self, empty_write_count: bool = True) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def dumps(self, path) -> None:
        pass

    def loads(self, path) -> None:
        pass

    @property
    def _cursor(self) -> int:
        return len(self._storage) if self._storage is not None else 0

    def __repr__(self) -> str:
        return "GroupWriter()"
