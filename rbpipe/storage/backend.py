"""The backend interface: where a store's group bytes live, and nothing else (docs/STORAGE.md).

A backend writes one group's columns somewhere and returns where (``loc``, recorded in the commit log by
the ledger), reads rows back as columns, and seals what it writes. It never reads the commit log: the
:class:`~rbpipe.storage.ledger.Ledger` replays it and tells the backend what happened through the
``LedgerEvents`` methods (a group committed, became live, was evicted or moved), and the backend reads the
ledger's state (schema, live groups, eviction mark) when it needs it.

What a backend can do beyond the minimum is declared as class attributes, in the manner of zarr-python's
``Store`` (``supports_writes``, ``supports_partial_writes``...), so that callers test a flag instead of
probing methods with ``hasattr``:

* ``compacts``: :meth:`Backend.write_compacted` rewrites live groups into one block (Arrow); else
  ``compact()`` is a no-op (Zarr rows are addressable one by one already).
* ``whole_tables``: :meth:`Backend.whole_table` returns a block's decoded columns as one contiguous table,
  so that whole sampled groups are copied by ``gather.concat_tables`` in one parallel loop.

Columns, as ``columns.py`` defines them: a fixed column is one ``[rows, *shape]`` array; a ragged column is
``(flat values, shapes)`` per gather and ``(flat values, offsets, shapes)`` in a whole table.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rbpipe.errors import StoreError
from rbpipe.storage.ledger import LedgerEvents

if TYPE_CHECKING:
    from rbpipe.storage.columns import GroupColumns
    from rbpipe.storage.ledger import Ledger


class WriteError(StoreError):
    """A group could not be written (nothing of it committed); ``why`` says the cause in plain words."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


def write_error(store: Path, err: OSError) -> WriteError:
    """A failed write of a group in plain words; what was half-written is unreachable (no commit line)."""
    plain: dict[int | None, str] = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exhausted",
                                    errno.EROFS: "the store is on a read-only file system",
                                    errno.EACCES: "permission denied", errno.EPERM: "operation not permitted"}
    why = plain.get(err.errno, str(err))
    if err.filename and err.errno in plain:
        why += f" ({err.filename})"
    return WriteError(f"could not write a group to the store {store}: {why}. Nothing of this group was "
                      "committed and the groups already stored are intact; free space / make the store "
                      "writable, then retry (or write to another --store)", why)


def writer_id() -> str:
    """Name of this process's segment: host, pid and a random part (a restarted pid gets a new one)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Backend(LedgerEvents):
    """Base of :class:`~rbpipe.storage.arrow_backend.ArrowBackend` and
    :class:`~rbpipe.storage.zarr_backend.ZarrBackend`.

    Args:
        path: the store directory.
        ledger: the store handle's ledger (read-only use: ``schema``, ``groups``, ``live_bytes``,
            ``evicted_upto``; ``refresh()`` before deleting files; ``move()`` after a compaction).
        evicts: whether this handle has retention (``max_size``/``max_bytes``).
    """

    name = ""  # as in rbpipe-store.json
    #: where a copy of the schema is kept (named by the error for a damaged schema line)
    schema_copy = ""
    compacts = False
    whole_tables = False

    def __init__(self, path: Path, ledger: Ledger, *, evicts: bool) -> None:
        self.path, self.ledger, self.evicts = path, ledger, evicts
        self.schema: Any = ledger.schema  # the store's ``layout.Schema`` (None until the first group)
        self._pins: dict[int, Any] = {}  # block -> what hold_block returned, while a held read runs

    def on_schema(self, schema: Any) -> None:
        self.schema = schema  # kept here: every gather reads it

    # -- writing ------------------------------------------------------------------------------------------
    def write_group(self, cols: GroupColumns) -> tuple[dict, int]:
        """Write one group's columns where no reader looks yet; ``(loc, bytes)`` for its commit record. An
        ``OSError`` leaves nothing a reader can reach (the caller commits nothing)."""
        raise NotImplementedError

    def seal(self) -> None:
        """Finish what this process writes (close its files); readers keep working."""

    def after_fork(self) -> None:
        """In a forked child: forget the parent's open files and write position (they stay the parent's)."""

    def writer_name(self) -> str:
        """The writer recorded with each commit (an evictor tells from it whether the writer is alive)."""
        return f"{socket.gethostname()}-{os.getpid()}"

    # -- reading ------------------------------------------------------------------------------------------
    def gather(self, block: int | None, local_rows: np.ndarray, keys: Sequence | None = None) -> dict:
        """Columns of ``local_rows`` of one block (``None``: empty columns)."""
        raise NotImplementedError

    def slice(self, block: int, first: int, stop: int, keys: Sequence | None = None) -> dict:
        """Columns of the consecutive rows ``first..stop`` of one block (backends return views)."""
        return self.gather(block, np.arange(first, stop), keys)

    def whole_table(self, block: int, first: int, stop: int) -> dict | None:
        """The decoded table of ``block`` when rows ``first..stop`` are all of it, else None (``whole_tables``)."""
        return None

    def hold_block(self, block: int) -> Any:
        """Open (map, or read into memory) what ``gather`` reads for ``block`` and return it: whoever keeps the
        returned object can read the block later through :meth:`pinned`, even once its groups are evicted and
        its file deleted (a mapped or read file stays readable)."""

    @contextlib.contextmanager
    def pinned(self, tables: dict[int, Any]) -> Iterator[None]:
        """Reads inside use ``tables`` (block -> what :meth:`hold_block` returned) for those blocks."""
        old, self._pins = self._pins, tables
        try:
            yield
        finally:
            self._pins = old

    # -- retention and maintenance ------------------------------------------------------------------------
    def after_commit(self) -> None:
        """After each commit of this handle, before retention runs."""

    def after_evict(self) -> None:
        """Groups were evicted: delete the files that hold no live group and nobody writes any more."""

    def disk_bound(self, writers: int) -> int:
        """The most the data files may hold now with ``writers`` writer processes (docs/FORMAT.md)."""
        raise NotImplementedError

    def check_tail(self, report: dict) -> dict:
        """``report`` (the commit log's) plus what this backend finds on disk but never committed."""
        return report

    def maintenance_lock(self) -> Any:
        """A context manager held by ``compact()`` (``compacts`` backends)."""
        raise NotImplementedError

    def compactable(self) -> list[dict]:
        """The live group records a compaction would rewrite (``compacts`` backends)."""
        return []

    def write_compacted(self, parts: list[dict], rows: int) -> tuple[str, dict]:
        """Write the gathered ``parts`` (one per group, in order) as one new block, not yet visible to
        evictors as unreferenced: ``(its file, its loc)``."""
        raise NotImplementedError

    def publish_compacted(self, name: str) -> None:
        """Make the block ``name`` :meth:`write_compacted` wrote readable under its final name (under the
        maintenance lock, before the ``move`` record)."""
        raise NotImplementedError

    def discard_compacted(self, name: str) -> None:
        """Delete the block ``name`` :meth:`write_compacted` wrote (none of its groups is still where it was read
        from, or the compaction failed)."""
        raise NotImplementedError

    def after_compaction(self, recs: list[dict], written: str) -> None:
        """The ``move`` record is written: delete what the compacted groups left behind."""
