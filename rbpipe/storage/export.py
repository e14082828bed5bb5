"""``rbpipe export``: copy a store's live groups into a new Zarr store (an archive, or for other tools)."""

from __future__ import annotations

import os

from rbpipe.storage.stores import open_storage


def export_zarr(store_path: str | os.PathLike, out_path: str | os.PathLike) -> int:
    """Copy every live group of a store (either backend) into a new Zarr store; returns groups exported."""
    from rbpipe.storage.zarr_storage import ZarrStorage

    src = open_storage(store_path)
    spans = src.group_spans()
    if not len(spans):
        ZarrStorage(out_path)
        return 0
    assert src.schema is not None  # a store with groups has its schema
    dst = ZarrStorage(out_path, ragged_keys=[c.key for c in src.schema.columns if c.ragged],
                      group_key=src.group_key, catalog_columns=src.catalog_columns)
    for _, a, b in spans.tolist():
        dst.append_group(src.get(slice(a, b)))
    dst.close()
    return len(spans)
