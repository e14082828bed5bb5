"""Opening a store of either backend by its path (the backend is named in ``rbpipe-store.json``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rbpipe.storage.format import read_meta

if TYPE_CHECKING:
    from rbpipe.storage.base import GroupStorage


def backends() -> dict[str, type]:
    """Backend name (as in ``rbpipe-store.json``) -> storage class."""
    from rbpipe.storage.arrow import ArrowStorage
    from rbpipe.storage.zarr_storage import ZarrStorage

    return {"arrow": ArrowStorage, "zarr": ZarrStorage}


def open_storage(path: str | os.PathLike, **kwargs) -> GroupStorage:
    """Open an existing store of either backend (never creates one)."""
    meta = read_meta(path)
    opts = meta.get("options", {})
    kwargs.setdefault("ragged_keys", [tuple(k) for k in opts.get("ragged_keys", [])])
    return backends()[meta["backend"]](path, create=False, **kwargs)
