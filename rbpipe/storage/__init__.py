"""Persistent group storage: Arrow (default) and Zarr backends, commit protocol, catalogue, writer lock.

See ``docs/FORMAT.md`` for the on-disk layout.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from rbpipe.storage.collate import collate_identity
from rbpipe.storage.format import FORMAT_VERSION
from rbpipe.storage.stores import backends, open_storage  # noqa: F401 - backends: public

if TYPE_CHECKING:
    from rbpipe.storage.base import GroupStorage

# Imported on first use (PEP 562): the catalogue, ``rbpipe inspect`` and ``rbpipe query`` read a store
# without torch, whose import alone costs seconds.
_LAZY = {"ArrowStorage": "rbpipe.storage.arrow", "ZarrStorage": "rbpipe.storage.zarr_storage",
         "GroupStorage": "rbpipe.storage.base", "GroupWriter": "rbpipe.storage.writer",
         "StoreLock": "rbpipe.storage.lock", "WriterLock": "rbpipe.storage.lock",
         "read_catalog": "rbpipe.storage.catalog", "catalog_table": "rbpipe.storage.catalog",
         "inspect_store": "rbpipe.storage.catalog", "export_zarr": "rbpipe.storage.export"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def group_buffer(storage: GroupStorage | str | os.PathLike, **kwargs):
    """A torchrl ``ReplayBuffer`` over a group store with the writer such a store needs: ``GroupWriter``
    (each ``add``/``extend`` commits one whole group). torchrl's default ``RoundRobinWriter`` writes at row
    positions it counts itself, which an append-only store cannot honour once it evicts or another
    process appends. ``storage`` may be a store's path (opened, never created); ``kwargs`` (sampler,
    batch_size, transform, ...) go to ``ReplayBuffer``."""
    from torchrl.data import ReplayBuffer

    from rbpipe.storage.base import GroupStorage
    from rbpipe.storage.writer import GroupWriter

    if not isinstance(storage, GroupStorage):
        storage = open_storage(storage)
    kwargs.setdefault("writer", GroupWriter())
    kwargs.setdefault("collate_fn", collate_identity)
    return ReplayBuffer(storage=storage, **kwargs)


__all__ = ["ArrowStorage", "ZarrStorage", "GroupWriter", "StoreLock", "open_storage", "read_catalog",
           "catalog_table", "inspect_store", "export_zarr", "FORMAT_VERSION", "GroupStorage", "collate_identity",
           "group_buffer"]
