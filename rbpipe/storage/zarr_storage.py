"""``ZarrStorage``: the same group store on Zarr v3 arrays (archive / export target; ``zarr_backend.py``)."""

from __future__ import annotations

from rbpipe.storage.base import GroupStorage
from rbpipe.storage.zarr_backend import ZarrBackend


class ZarrStorage(GroupStorage):
    """A torchrl ``Storage`` of whole groups in a Zarr v3 group (``STORE/data.zarr``); same API as
    :class:`ArrowStorage` (``compact()`` is a no-op). See ``docs/FORMAT.md``.

    With retention, chunk files whose groups are all evicted are deleted once their writer has moved past
    them: the chunk files are those holding a live group plus at most two per writer and array
    (docs/FORMAT.md, "Retention and disk").

    Examples:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> store = ZarrStorage(tempfile.mkdtemp() + "/store")
        >>> store.append_group(TensorDict({"group_id": torch.zeros(2), "x": torch.ones(2, 3)}, [2])).tolist()
        [0, 1]
        >>> len(store)
        2
    """

    backend_class = ZarrBackend
    backend = ZarrBackend.name
