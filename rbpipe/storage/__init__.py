"""Persistent group storage: Arrow (default) and Zarr backends, commit protocol, catalogue, writer lock.

See ``docs/FORMAT.md`` for the on-disk layout.
"""

from __future__ import annotations

import os

from rbpipe.storage.arrow import ArrowStorage
from rbpipe.storage.base import GroupStorage
from rbpipe.storage.catalog import export_zarr, inspect_store, read_catalog
from rbpipe.storage.format import FORMAT_VERSION, read_meta
from rbpipe.storage.lock import WriterLock
from rbpipe.storage.writer import GroupWriter
from rbpipe.storage.zarr_storage import ZarrStorage

BACKENDS = {"arrow": ArrowStorage, "zarr": ZarrStorage}


def open_storage(path: str | os.PathLike, **kwargs) -> GroupStorage:
    """Open an existing store of either backend (never creates one)."""
    meta = read_meta(path)
    opts = meta.get("options", {})
    kwargs.setdefault("ragged_keys", [tuple(k) for k in opts.get("ragged_keys", [])])
    return BACKENDS[meta["backend"]](path, create=False, **kwargs)


def collate_identity(data):
    """``collate_fn`` for a plain ``ReplayBuffer`` over these storages (torchrl has no default for them)."""
    return data


__all__ = ["ArrowStorage", "ZarrStorage", "GroupWriter", "WriterLock", "open_storage", "read_catalog",
           "inspect_store", "export_zarr", "FORMAT_VERSION", "GroupStorage", "collate_identity"]
