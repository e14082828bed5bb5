"""``ArrowStorage``: the default store (Arrow IPC segments, memory-mapped; ``arrow_backend.py``)."""

from __future__ import annotations

from rbpipe.storage.arrow_backend import ArrowBackend
from rbpipe.storage.base import GroupStorage


class ArrowStorage(GroupStorage):
    """A torchrl ``Storage`` of whole groups on disk (Arrow IPC, memory-mapped). See ``docs/FORMAT.md``.

    Args:
        path: store directory (created if absent and ``create``).

    Keyword Args:
        max_size: live rows kept (oldest whole groups are evicted beyond it); None = unbounded.
        max_bytes: same, in bytes of group data. With either, evicted groups' files are deleted too: the
            segment files hold at most ``2 L + (W + 1) (R + G)`` bytes (``L`` live bytes, ``G`` the largest
            group, ``W`` writer processes, ``R = max(256 KiB, L / 8)`` the size at which a writer starts a
            new segment; docs/FORMAT.md, "Retention and disk").
        ragged_keys: keys whose per-row shape varies (also detected from the first write).
        ragged_layout: how reads return ragged keys: ``"nested"`` (jagged ``torch.nested`` tensors: one values
            tensor plus offsets per field, no padding; the default when every ragged field is 1-D and real),
            ``"rows"`` (a LazyStackedTensorDict of rows, torchrl's LLM convention; the default otherwise; use
            it to index the sampled batch, which nested tensors do not allow along rows) or ``"padded"``
            (dense, zero-padded to the batch's longest row, lengths under ``("lengths", *key)``).
        group_key: key holding the group id (recorded in the catalogue).
        catalog_columns: catalogue column -> (key, "value" | "length"); default: returns, advantages,
            collectors, policy_versions, lengths (columns whose key is absent are skipped).
        create: create the store when ``path`` is not one yet.

    Examples:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> store = ArrowStorage(tempfile.mkdtemp() + "/store")
        >>> store.append_group(TensorDict({"group_id": torch.zeros(4), "x": torch.ones(4, 2)}, [4])).tolist()
        [0, 1, 2, 3]
        >>> store.get(slice(0, 4))["x"].shape
        torch.Size([4, 2])
    """

    backend_class = ArrowBackend
    backend = ArrowBackend.name
