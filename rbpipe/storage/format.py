"""Store directory layout, metadata file and format version (see docs/FORMAT.md).

A store is a directory holding ``rbpipe-store.json``; everything else is found from there. Opening a
path that is not a store (or a store of another format version) fails with a :class:`StoreError` that
says how to fix it, before any data file is touched.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from rbpipe.errors import StoreError
from rbpipe.system.fsutil import atomic_write

#: Bumped when a reader of the previous version could misread a store.
FORMAT_VERSION = 1
META_FILE = "rbpipe-store.json"
COMMIT_LOG = "commits.jsonl"
SEGMENTS_DIR = "segments"
CATALOG_DIR = "catalog"
ZARR_DIR = "data.zarr"
BACKENDS = ("arrow", "zarr")


def _fix_hint(path: Path) -> str:
    return (f"pass a new (or empty) directory to create a store there, or the directory of an existing "
            f"store (it contains {META_FILE}); got {str(path)!r}")


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a store's metadata; raise StoreError for anything that is not a usable store."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise StoreError(f"{str(path)!r} is a file, not a store directory: {_fix_hint(path)}")
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise StoreError(f"{str(path)!r} is not an rbpipe store (no {META_FILE}): {_fix_hint(path)}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise StoreError(f"the store metadata {str(meta_path)!r} is unreadable ({exc}); restore it from "
                         "a backup or export the data with a matching rbpipe version") from None
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise StoreError(
            f"store {str(path)!r} has format_version {version!r} but this rbpipe reads version "
            f"{FORMAT_VERSION}; open it with the rbpipe release that wrote it, or export it there "
            "(rbpipe export) and re-import")
    if meta.get("backend") not in BACKENDS:
        raise StoreError(f"store {str(path)!r} names an unknown backend {meta.get('backend')!r}; "
                         f"expected one of {BACKENDS}")
    _check_commit_log(path)
    return meta


def _holds_data(path: Path) -> bool:
    """Whether anything but the metadata was ever written to the store (segments, arrays, catalogue)."""
    return any(any(d.iterdir()) for d in (path / SEGMENTS_DIR, path / CATALOG_DIR) if d.is_dir()) or any(
        (path / name).exists() for name in (ZARR_DIR, "zarr_alloc.json"))


def _check_commit_log(path: Path) -> None:
    """Refuse a store whose commit log is gone but whose data is not: opened, it would read as empty and
    take new groups while the old ones (still in the catalogue) stay orphaned. A store that never held data
    (its creator stopped before the log existed) is fine: the log is created on open."""
    if not (path / COMMIT_LOG).is_file() and _holds_data(path):
        raise StoreError(f"store {str(path)!r} holds data but its commit log {COMMIT_LOG} is missing; the log is "
                         "the only record of which groups exist, so the store will not open (it would read as "
                         f"empty): restore {COMMIT_LOG} from a backup, or move the directory aside and start a "
                         "new store")


def create_or_open(path: str | os.PathLike, backend: str, *, create: bool,
                   options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Open the store at ``path`` (checking its backend), creating it first if allowed and absent."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise StoreError(f"{str(path)!r} is a file, not a store directory: {_fix_hint(path)}")
    if not (path / META_FILE).exists():
        if not create:
            raise StoreError(f"{str(path)!r} is not an rbpipe store (no {META_FILE}) and create=False: "
                             f"{_fix_hint(path)}")
        if path.exists() and any(p.name != ".lock" for p in path.iterdir()):
            raise StoreError(f"{str(path)!r} is a non-empty directory that is not an rbpipe store; "
                             "refusing to write into it: pass a new or empty directory")
        path.mkdir(parents=True, exist_ok=True)
        if backend == "arrow":
            (path / SEGMENTS_DIR).mkdir(exist_ok=True)
        (path / CATALOG_DIR).mkdir(exist_ok=True)
        (path / COMMIT_LOG).touch(exist_ok=True)  # before the metadata: a store that has one has both
        meta = {"format_version": FORMAT_VERSION, "backend": backend, "created": time.time(),
                "created_by": f"{socket.gethostname()}:{os.getpid()}", "options": options or {}}
        # linked, not renamed, into place: if a concurrent creator won, theirs is kept
        atomic_write(path / META_FILE, json.dumps(meta, indent=1), fsync=False, replace=False)
    meta = read_meta(path)
    if meta["backend"] != backend:
        raise StoreError(f"store {str(path)!r} was created with the {meta['backend']!r} backend, not "
                         f"{backend!r}; open it with rbpipe.storage.open_storage(path)")
    return meta
