"""``GroupStorage``: torchrl's ``Storage`` over the three parts of a store (docs/STORAGE.md).

* the ledger (``ledger.py``) reads the commit log: which groups are live, their rows, retention;
* a backend (``arrow_backend.py``, ``zarr_backend.py``) holds the bytes: writes a group, gathers rows;
* the decoder (``decoder.py``) turns gathered columns into a TensorDict.

This class only adapts them to torchrl: it turns an index into rows of blocks, commits a write through the
backend then the ledger, applies retention, buffers catalogue rows and pickles as its path. Rows are
numbered by *position* among the live groups in commit order (see ``ledger.Ledger``).

Size (over 500 lines): torchrl's ``Storage`` interface (index reads, ``set``, ``len``, ``dumps``/``loads``,
``state_dict``) and the store's own reads (by group, by column, snapshots) are one class's API; what has a job of
its own is already outside it (ledger, backends, decoder, catalogue).
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.data.replay_buffers.storages import Storage

from rbpipe.errors import SchemaError, StaleReadError, StoreError
from rbpipe.storage.backend import Backend, write_error
from rbpipe.storage.collate import register_default_collate
from rbpipe.storage.columns import ColumnSet, NestedKey, from_storage_np, key_tuple, take_ragged
from rbpipe.storage.decoder import check_layout, choose_layout, concat_parts, to_tensordict
from rbpipe.storage.format import FORMAT_VERSION, create_or_open
from rbpipe.storage.gather import concat_tables, whole_groups
from rbpipe.storage.group_index import View
from rbpipe.storage.ledger import Ledger
from rbpipe.trajectory import ADVANTAGE_KEY, COLLECTOR_KEY, GROUP_KEY, RESPONSE_TOKENS_KEY, REWARD_KEY, VERSION_KEY

if TYPE_CHECKING:
    from rbpipe.storage.catalog import CatalogBuffer

UNBOUNDED = torch.iinfo(torch.int64).max
MAX_PINS = 4  # held reads kept (a sampler holds each draw until its read; torchrl may prefetch a few)


class _Pin(NamedTuple):
    """A draw held for its read: its rows, the numbering they were drawn under, and its blocks kept open."""

    rows: np.ndarray
    view: View
    tables: dict[int, Any]

DEFAULT_CATALOG_COLUMNS: dict[str, tuple[NestedKey, str]] = {
    "returns": (REWARD_KEY, "value"),
    "advantages": (ADVANTAGE_KEY, "value"),
    "collectors": (COLLECTOR_KEY, "value"),
    "policy_versions": (VERSION_KEY, "value"),
    "lengths": (RESPONSE_TOKENS_KEY, "length"),
}


class GroupStorage(Storage):
    """Base class of :class:`ArrowStorage` and :class:`ZarrStorage` (see their docs); a subclass names its
    ``backend_class``. Implements ``rbpipe.storage.protocol.GroupStore`` (what the buffer relies on)."""

    backend_class: type[Backend] = Backend
    backend = ""
    #: the buffer may hand members of varying lengths over as one TensorDict of jagged leaves
    accepts_jagged = True
    #: ``append_group`` takes ``commit_id``/``member_ids`` (idempotent recovery writes)
    idempotent_commits = True
    #: ``hold(index)`` opens what a read of ``index`` needs (the sampler draws again on StaleReadError)
    holds_reads = True

    def __init__(self, path: str | os.PathLike, *, max_size: int | None = None, max_bytes: int | None = None,
                 ragged_keys: Sequence[NestedKey] = (), group_key: NestedKey = GROUP_KEY,
                 catalog_columns: Mapping[str, tuple[NestedKey, str]] | None = None, create: bool = True,
                 catalog_every: int = 256, catalog_interval_s: float = 5.0,
                 ragged_layout: str | None = None) -> None:
        if max_size is not None and max_size < 1:
            raise StoreError(f"max_size must be a positive number of rows or None, got {max_size}")
        # compilable: torchrl's revision and cursor counters as plain tensors, not ``multiprocessing.Value``s.
        # Every process opens the store itself (pickling reopens it by path), so nothing is shared through
        # them, and each Value is a named semaphore that leaks in /dev/shm when its process is killed
        super().__init__(max_size=UNBOUNDED if max_size is None else max_size, compilable=True)
        self._init_args = dict(max_size=max_size, max_bytes=max_bytes,
                               ragged_keys=[list(key_tuple(k)) for k in ragged_keys], group_key=group_key,
                               catalog_columns=None if catalog_columns is None else
                               {k: (list(key_tuple(v[0])), v[1]) for k, v in catalog_columns.items()},
                               create=create, catalog_every=catalog_every,
                               catalog_interval_s=catalog_interval_s, ragged_layout=ragged_layout)
        check_layout(ragged_layout)
        self._layout_asked = ragged_layout
        self.path = Path(path).absolute()
        self.max_bytes = max_bytes
        self.ragged_keys = tuple(key_tuple(k) for k in ragged_keys)
        self.group_key = key_tuple(group_key)
        cat = DEFAULT_CATALOG_COLUMNS if catalog_columns is None else catalog_columns
        for name, (_, red) in cat.items():
            if red not in ("value", "length"):
                raise StoreError(f"catalog column {name!r} has reduction {red!r}; use 'value' or 'length'")
        self.catalog_columns = {name: (key_tuple(k), red) for name, (k, red) in cat.items()}
        self.catalog_every, self.catalog_interval_s = catalog_every, catalog_interval_s
        self.meta = create_or_open(self.path, self.backend, create=create,
                                   options={"ragged_keys": self._init_args["ragged_keys"]})
        self._ledger = Ledger(self.path, schema_copy=self.backend_class.schema_copy)
        evicts = self.max_size != UNBOUNDED or max_bytes is not None
        self._backend = self._ledger.events = self.backend_class(self.path, self._ledger, evicts=evicts)
        self._pid = os.getpid()
        self._catalog: CatalogBuffer | None = None  # made at the first commit (pyarrow is imported then)
        self._refresh()
        self._view: View = self._ledger.index.view()  # the numbering tensor indices are read against
        self._pins: OrderedDict[bytes, _Pin] = OrderedDict()  # held draws, by their rows
        #: what failed after a commit and is retried (``"retention"``, ``"catalogue"`` -> the last error, plain)
        self.maintenance_errors: dict[str, str] = {}
        self.torn_tail = self.check_tail()

    # -- the ledger's state, under the names tests and retention.disk_bound read -------------------------
    _log = property(lambda self: self._ledger.log)
    _apply = property(lambda self: self._ledger.apply)
    _groups = property(lambda self: self._ledger.groups)
    _live_bytes = property(lambda self: self._ledger.live_bytes)
    _schema = property(lambda self: self._ledger.schema)

    def _refresh(self) -> None:
        """Read what other processes committed. The numbering of reads (:meth:`_take_view`) stays as it was."""
        self._ledger.refresh()

    def _take_view(self) -> View:
        """Refresh and make the current numbering the one integer indices are read against: ``len()``,
        ``group_spans()`` and ``append_group()`` do, the calls a caller learns row numbers from. Nothing else
        renumbers them (a failed read, ``schema``, ``live_bytes``...): rows drawn from one of those calls
        keep naming the groups they named, whatever was evicted since."""
        self._ledger.refresh()
        self._view = self._ledger.index.view()
        return self._view

    def committed_member_ids(self) -> set[str]:
        """Every ``member_ids`` entry ever committed (evicted groups included): lets a recovering writer
        tell which of its pending items already reached the store."""
        self._refresh()
        return set(self._ledger.member_ids)

    def __len__(self) -> int:
        return self._take_view().rows

    def group_spans(self) -> torch.Tensor:
        """``[n_groups, 3]`` int64: (commit sequence number, first row, stop row) of live groups, oldest first.
        Integer indices are read against these rows until the next ``len()``/``group_spans()``/append."""
        seqs, starts, stops = self._take_view().arrays()[:3]
        return torch.from_numpy(np.stack([seqs, starts, stops], 1) if len(seqs) else np.zeros((0, 3), np.int64))

    @property
    def ragged_layout(self) -> str:
        """The layout reads use (``decoder.choose_layout``): as asked, else ``"nested"`` when every ragged
        field is 1-D and real, else ``"rows"``."""
        return choose_layout(self._layout_asked, self._ledger.schema)

    @property
    def schema(self) -> ColumnSet | None:
        self._refresh()
        return self._schema

    @property
    def live_bytes(self) -> int:
        """Bytes of group data in the live groups (what ``max_bytes`` limits; the disk bound is stated in it)."""
        self._refresh()
        return self._live_bytes

    # -- writes -------------------------------------------------------------------------------------------
    def append_group(self, td: TensorDictBase, *, commit_id: str | None = None,
                     member_ids: list[str] | None = None) -> torch.Tensor:
        """Commit one whole group atomically; return its row indices (positions at commit time).

        ``commit_id`` makes the commit idempotent: if a group with that id is already in the commit log (a
        writer committed it and died before reporting it, and a recovery writes it again), nothing new is
        committed and an empty index is returned. The check runs under the commit-log lock. ``member_ids``
        (opaque strings naming what this commit consumed, e.g. staged payloads) are recorded with it: see
        :meth:`committed_member_ids`. ``td`` may hold members of varying lengths as jagged leaves.

        The commit line is the last thing that can fail: the schema is committed only once the group passed
        its checks, and what follows the commit (retention, file deletion, the catalogue) never raises: a
        failure there is recorded (:attr:`maintenance_errors`, a warning) and retried at later commits and at
        :meth:`close` (the commit log stays the truth; ``repair_catalog`` rebuilds the catalogue from it).
        A caller that sees an error can therefore retry: nothing of the group was committed.
        """
        from rbpipe.storage.catalog import CatalogBuffer, catalog_values

        if os.getpid() != self._pid:
            self._after_fork()
        ledger = self._ledger
        ledger.refresh()
        schema = ledger.schema if ledger.schema is not None else ColumnSet.infer(td, self.ragged_keys)
        cols = schema.split(td)  # raises SchemaError before anything is written, the first group's schema too
        try:
            first = ledger.schema is None
            if first:  # this group is accepted: its schema becomes the store's, unless another writer's won
                ledger.commit_schema(schema)
            if first and ledger.schema.to_json() != schema.to_json():
                cols = ledger.schema.split(td)
            loc, nbytes = self._backend.write_group(cols)
        except OSError as err:
            raise write_error(self.path, err) from err
        gid = None
        if self.group_key in cols.fixed and cols.fixed[self.group_key].size:
            gid = cols.fixed[self.group_key].reshape(-1)[0].item()
        record = {"t": "group", "n": cols.n, "loc": loc, "bytes": nbytes, "gid": gid,
                  "cat": catalog_values(cols, ledger.schema, self.catalog_columns),
                  "writer": self._backend.writer_name()}
        try:
            rec = ledger.commit_group(record, commit_id, member_ids)
        except OSError as err:
            raise write_error(self.path, err) from err
        if rec is None:
            return torch.zeros(0, dtype=torch.int64)
        # committed: from here on nothing raises (a caller retrying a "failed" write would store it twice)
        self._maintain("retention", self._retain)
        if self._catalog is None:
            self._catalog = CatalogBuffer(self.path, self.catalog_columns, self.catalog_every,
                                          self.catalog_interval_s)
        self._catalog.pending.append(rec)
        self._maintain("catalogue", self._catalog.flush_due)
        self._view = ledger.index.view()  # the numbering the returned rows are in
        start = ledger.index.start_of(rec["seq"])
        if start is None:  # evicted at once (larger than max_size/max_bytes)
            return torch.zeros(0, dtype=torch.int64)
        self._bump_mutation_revision()
        return torch.arange(start, start + cols.n)

    def _maintain(self, what: str, job) -> bool:
        """Run ``job`` (work after a commit: retention, the catalogue); an ``OSError`` is recorded in
        :attr:`maintenance_errors` and warned about once, never raised (the job runs again at the next
        commit or ``close``). Whether it succeeded."""
        try:
            job()
        except OSError as err:
            first = what not in self.maintenance_errors
            self.maintenance_errors[what] = f"{what} of the store {self.path}: {write_error(self.path, err).why}"
            if first:
                warnings.warn(f"{self.maintenance_errors[what]}; the groups are committed (the commit log is the "
                              "truth), and this is retried at the next commit and at close()", RuntimeWarning,
                              stacklevel=3)
            return False
        self.maintenance_errors.pop(what, None)
        return True

    def _retain(self) -> None:
        """Evict the oldest groups beyond ``max_size``/``max_bytes`` and free their files (the disk bound of
        docs/FORMAT.md, "Retention and disk", holds after every commit)."""
        self._backend.after_commit()
        if self.max_size == UNBOUNDED and self.max_bytes is None:
            return
        max_bytes = self.max_bytes
        if self._ledger.evict_over(self.max_size, max_bytes):
            self._backend.after_evict()

    def set(self, cursor, data, *, set_cursor: bool = True):
        """torchrl writer entry point. The store is append-only: only the rows right after the last one may
        be written (one new group); any other position (a slice included) is refused before anything is
        written, since silently appending would put the data somewhere the caller did not ask for."""
        from rbpipe.storage.columns import check_group

        data = check_group(data)
        n = len(self)
        refused = self._not_at_end(cursor, n)
        if refused:
            raise StoreError(f"{type(self).__name__} is append-only: cannot write rows {refused}, only one new "
                             f"group at the end (from row {n}); build the buffer with "
                             "writer=rbpipe.storage.GroupWriter() (torchrl's default RoundRobinWriter cycles "
                             "through row positions) or with rbpipe.storage.group_buffer(...)")
        return self.append_group(data if data.ndim else data.unsqueeze(0))

    @staticmethod
    def _not_at_end(cursor, n: int) -> str:
        """The rows ``cursor`` names, shown, unless they are ``n, n+1, ...`` (the end of a store of ``n``
        rows; a slice must start there and step by 1); "" when they are."""
        if isinstance(cursor, slice):
            if (cursor.start or 0) == n and cursor.step in (None, 1):
                return ""
            text = ":".join("" if x is None else str(x) for x in (cursor.start, cursor.stop, cursor.step))
            return f"[{text.rstrip(':') or ':'}]"
        rows = torch.as_tensor(cursor).reshape(-1).tolist()
        if rows == list(range(n, n + len(rows))):
            return ""
        return str(rows[:4])[:-1] + (", ...]" if len(rows) > 4 else "]")

    def flush_catalog(self) -> None:
        """Write pending catalogue rows as one parquet file (tmp name, then rename)."""
        if self._catalog is not None:
            self._catalog.flush()

    def close(self) -> None:
        """Seal this process's segment (readers keep working), then retry what failed after a commit
        (retention's file deletion) and flush the catalogue. Those two only warn when they fail again: every
        group is committed, and ``repair_catalog`` writes the catalogue rows a failed flush left out."""
        if os.getpid() == self._pid:
            self._backend.seal()
            if "retention" in self.maintenance_errors:
                self._maintain("retention", self._backend.after_evict)
            if self._catalog is not None:
                self._maintain("catalogue", self._catalog.flush)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- reads --------------------------------------------------------------------------------------------
    def _rows(self, index) -> tuple[np.ndarray, bool]:
        """``index`` as int64 rows (and whether it was a scalar). Integer tensors and arrays (what samplers
        hand over) are read against the numbering of the last ``len()``/``group_spans()``/append
        (:meth:`_take_view`), which a sampler calls before it draws: an eviction in between does not shift the
        drawn rows under it. A row past that numbering, or any other kind of index, takes a new one first."""
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        if isinstance(index, (torch.Tensor, np.ndarray)) and index.ndim == 1:
            if type(index) is torch.Tensor and index.dtype == torch.int64:
                rows = index.numpy()  # a view, no conversion
            else:
                rows = np.asarray(torch.as_tensor(index).numpy(), dtype=np.int64)
            if not rows.size or rows.view(np.uint64).max() < self._view.rows:  # one pass: negatives read huge
                return rows, False
            return self._in_range(rows, len(self)), False
        n = len(self)
        if isinstance(index, (int, np.integer)) or (isinstance(index, torch.Tensor) and index.ndim == 0):
            rows, scalar = np.asarray([int(index)], np.int64), True
        elif isinstance(index, slice):
            rows, scalar = np.arange(*index.indices(n), dtype=np.int64), False
        elif isinstance(index, range):
            rows, scalar = np.asarray(index, np.int64), False
        else:
            rows, scalar = np.asarray(torch.as_tensor(index).reshape(-1).numpy(), dtype=np.int64), False
        return self._in_range(rows, n), scalar

    @staticmethod
    def _in_range(rows: np.ndarray, n: int) -> np.ndarray:
        """``rows`` with negative rows counted from the end (a new array: the caller's is never modified)."""
        if rows.size and rows.view(np.uint64).max() >= n:
            low = rows.min()
            if low < 0:
                rows = np.where(rows < 0, rows + n, rows)
                low = rows.min()
            if low < 0 or rows.max() >= n:
                raise IndexError(f"row index out of range for a store of {n} rows")
        return rows

    def _gather_rows(self, rows: np.ndarray, view: View) -> dict[tuple, Any]:
        """Columns of ``rows`` (numbered as in ``view``): fixed ones as one array, ragged ones as a list of
        (flat values, shapes) parts in row order. Parts are views of the mapped segments where possible:
        concatenating them here would allocate (and page-fault in) a fresh buffer on every sample."""
        backend, columns = self._backend, self._schema.columns
        one = view.one
        if one is not None and rows.size:  # a compacted store: one gather, no per-row block lookup
            parts = [backend.gather(one[0], rows + one[1])]
            return {c.key: [p[c.key] for p in parts] if c.ragged else parts[0][c.key] for c in columns}
        seqs, starts, stops, blocks, local = view.arrays()
        groups = whole_groups(rows, starts, stops)
        if groups is not None and len(groups) > 1 and backend.whole_tables:
            # whole groups (what GRPO samples) of whole blocks: one multi-threaded copy (a single group is
            # returned as views of its block below, without a copy)
            n = stops[groups] - starts[groups]
            tables = [backend.whole_table(b, a, a + k)
                      for b, a, k in zip(blocks[groups].tolist(), local[groups].tolist(), n.tolist(), strict=True)]
            whole = [t for t in tables if t is not None]
            if len(whole) == len(tables):
                concatenated = concat_tables(columns, whole, len(rows))
                if concatenated is not None:
                    return concatenated
        g = np.searchsorted(stops, rows, side="right")
        blk = blocks[g]
        loc = rows - starts[g] + local[g]
        if rows.size == 0:
            parts, inv = [backend.gather(None, loc)], None
        else:
            # runs of consecutive rows of one block (e.g. whole groups): one slice per column each
            runs = np.flatnonzero((np.diff(blk) != 0) | (np.diff(loc) != 1)) + 1
            if len(runs) < 64:
                first, last = np.concatenate(([0], runs)), np.concatenate((runs, [len(rows)])) - 1
                spans = zip(blk[first].tolist(), loc[first].tolist(), (loc[last] + 1).tolist(), strict=True)
                parts = [backend.slice(b, a, z) for b, a, z in spans]
                inv = None
            elif (blk == blk[0]).all():  # scattered rows of one block (a compacted store): one gather
                parts, inv = [backend.gather(int(blk[0]), loc)], None
            else:  # scattered rows: one gather per block, then back to the order asked for
                order = np.argsort(blk, kind="stable")
                sorted_blk = blk[order]
                cuts = np.flatnonzero(np.diff(sorted_blk)) + 1
                parts = [backend.gather(int(sorted_blk[s]), loc[order[s:e]])
                         for s, e in zip(np.r_[0, cuts], np.r_[cuts, len(order)], strict=True)]
                inv = np.argsort(order)
        out: dict[tuple, Any] = {}
        for c in columns:
            if c.ragged:
                out[c.key] = [p[c.key] for p in parts]
                if inv is not None:
                    out[c.key] = [take_ragged(*concat_parts(out[c.key]), c, inv)]
            elif len(parts) == 1:
                out[c.key] = parts[0][c.key]
            else:
                merged = np.concatenate([p[c.key] for p in parts])
                out[c.key] = merged if inv is None else merged[inv]
        return out

    def get(self, index) -> TensorDictBase:
        """Rows as a dense TensorDict (no ragged key) or, with ragged keys, depending on ``ragged_layout``:
        ``"nested"`` (the default where possible), a TensorDict whose ragged keys are jagged ``torch.nested``
        tensors (values + offsets, no copy per row, no padding); ``"rows"``, a LazyStackedTensorDict of rows;
        ``"padded"``, a dense TensorDict right-padded with zeros plus each ragged key's per-row length under
        ``("lengths", *key)``.

        Integer indices are read against the numbering they were drawn from (see :meth:`_rows`); an index
        passed to :meth:`hold` first is read exactly as held, whatever was evicted or renumbered since."""
        pin = self._pin_of(index)
        if pin is not None:
            rows, scalar, view = pin.rows, False, pin.view
        else:
            rows, scalar = self._rows(index)
            view = self._view
        if self._schema is None:
            raise IndexError("the store is empty")
        with self._backend.pinned(pin.tables if pin is not None else {}):
            data = self._read_snapshot(self._gather_rows, rows, view)
        td = to_tensordict(self._schema, self.ragged_layout, data, len(rows))
        return td[0] if scalar else td

    def _read_snapshot(self, read, rows: np.ndarray, view: View):
        """``read(rows, view)``, where ``rows`` number the live groups of ``view``. If a file is gone, a
        compaction moved those groups (refresh: they are read where they are now), an eviction deleted them
        (:class:`StaleReadError`), or nothing explains it (a :class:`StoreError` naming the file): never the
        same row numbers under a newer numbering, which would be other groups."""
        for _ in range(3):
            try:
                return read(rows, view)
            except FileNotFoundError as err:
                rows, moved = self._remap(rows, view, err)
                if view is self._view and moved.same_numbering(view):
                    self._view = moved  # files moved, numbering kept: later reads go there at once
                view = moved
        raise StaleReadError(f"the groups read from {self.path} kept moving (compactions); draw again")

    def _remap(self, rows: np.ndarray, view: View, err: FileNotFoundError) -> tuple[np.ndarray, View]:
        """Where the groups of ``rows`` (numbered as in ``view``) are after a refresh, with that numbering;
        StaleReadError when one of them was evicted since. ``err`` (a file of theirs is missing) with every
        one of them still live where ``view`` had it is damage: a StoreError naming the file (retention and
        ``compact()`` record an eviction or a move before they delete a file)."""
        g = np.searchsorted(view.stops, rows, side="right")
        want, offset, was = view.seqs[g], rows - view.starts[g], view.blocks[g]
        self._ledger.refresh()
        now = self._ledger.index.view()
        i = np.minimum(np.searchsorted(now.seqs, want), max(len(now.seqs) - 1, 0))
        if not len(now.seqs) or (now.seqs[i] != want).any():
            raise StaleReadError(f"rows drawn from {self.path} belong to groups evicted (and deleted) since; "
                                 "take the rows again (len(storage) or group_spans()) and draw again")
        if (now.blocks[i] == was).all():
            seqs = np.unique(want).tolist()
            raise StoreError(f"the data file {err.filename!r} of the store {str(self.path)!r} is missing, but the "
                             f"commit log says its group(s) (seq {', '.join(map(str, seqs[:4]))}"
                             f"{', ...' if len(seqs) > 4 else ''}) are live there: it was deleted or moved by hand "
                             "(rbpipe deletes a file only after recording an eviction or a move); restore it from "
                             "a backup") from None
        return now.starts[i] + offset, now

    def _pin_of(self, index) -> _Pin | None:
        """The held draw whose rows are ``index`` (the tensor a sampler returned after :meth:`hold`), if any."""
        if not self._pins or not isinstance(index, (torch.Tensor, np.ndarray)) or index.ndim != 1:
            return None
        rows = index.numpy() if isinstance(index, torch.Tensor) else index
        if rows.dtype != np.int64:
            return None
        return self._pins.get(rows.tobytes())

    def hold(self, index, *, group_seqs: Sequence[int] | None = None) -> None:
        """Keep what ``get(index)`` reads open, under the numbering ``index`` was drawn from (the last
        ``len()``/``group_spans()``), so that that read returns exactly the drawn groups: a later refresh
        renumbers nothing for it, and an evictor deleting their files meanwhile changes nothing (a mapped or
        read file stays readable). A sampler calls it before handing ``index`` out, and draws again on
        :class:`StaleReadError`: the drawn groups' files are gone already, or ``group_seqs`` (the commit
        sequence numbers of the drawn groups) are not the groups ``index`` names in that numbering."""
        rows, _ = self._rows(index)
        if not rows.size or self._schema is None:
            return
        view = self._view
        g = np.searchsorted(view.stops, rows, side="right")
        if group_seqs is not None and np.unique(view.seqs[g]).tolist() != sorted(int(s) for s in group_seqs):
            raise StaleReadError(f"the rows drawn from {self.path} no longer name the groups drawn (the store was "
                                 "renumbered between the draw and the hold); draw again")
        tables = {}
        for b in np.unique(view.blocks[g]).tolist():
            try:
                tables[b] = self._backend.hold_block(b)
            except FileNotFoundError as err:
                self._remap(rows, view, err)  # StaleReadError if evicted, StoreError if damaged
                raise StaleReadError(f"rows drawn from {self.path} belong to groups moved by compact() since; "
                                     "draw again") from err
        self._pins[rows.tobytes()] = _Pin(rows.copy(), view, tables)
        self._pins.move_to_end(rows.tobytes())
        while len(self._pins) > MAX_PINS:
            self._pins.popitem(last=False)

    def read_column(self, key: NestedKey, rows=None) -> torch.Tensor:
        """A fixed-shape column (all live rows, or ``rows``) as one tensor; the samplers' fast path. Like
        ``get``, integer ``rows`` are read against the last refresh (the one the sampler drew them from)."""
        key = key_tuple(key)
        if rows is None or self._schema is None:
            self._refresh()
        col = self._schema.by_key.get(key) if self._schema else None
        if col is None or col.ragged:
            raise SchemaError(f"read_column needs a fixed-shape column; {'.'.join(key)!r} is "
                              f"{'ragged' if col else 'not in the store'}")
        r, _ = self._rows(slice(None) if rows is None else rows)
        return self._read_snapshot(lambda r, view: self._read_column(col, r, view), r, self._view)

    def group_minimums(self, key: NestedKey, seqs: Sequence[int]) -> dict[int, int]:
        """The smallest value of the one-element integer column ``key`` in each live group of ``seqs``, from the
        group's commit record (its catalogue values): no data is read. A waiting learner checks every new
        group's oldest policy version; reading the column for them was a visible part of every learner step (figures:
        docs/DESIGN.md, Figures behind code choices).

        Groups whose record does not carry it (no catalogue column sums ``key``, or the group is not live) are
        left out: read those with :meth:`read_column`. Like ``read_column``, against the last refresh. The
        records' catalogue names are read with this handle's ``catalog_columns``: open every handle of a store
        with the same ones (rbpipe's processes all use the defaults)."""
        key = key_tuple(key)
        col = self._schema.by_key.get(key) if self._schema else None
        if col is None or col.ragged or int(np.prod(col.shape)) != 1 or col.np_dtype.kind not in "iu":
            return {}  # a sum over several elements, or of floats, is not the value itself
        names = [name for name, (k, red) in self.catalog_columns.items() if k == key and red == "value"]
        groups, out = self._groups, {}
        for seq in seqs:
            rec = groups.get(int(seq))
            values = rec.get("cat", {}).get(names[0]) if rec is not None and names else None
            if values:
                out[int(seq)] = int(min(values))
        return out

    def _read_column(self, col, r: np.ndarray, view: View) -> torch.Tensor:
        key = col.key
        seqs, starts, stops, blocks, local = view.arrays()
        g = np.searchsorted(stops, r, side="right")
        blk, loc = blocks[g], r - starts[g] + local[g]
        out = np.empty((len(r), *col.shape, *((2,) if col.complex else ())), col.np_dtype)
        for b in np.unique(blk):
            m = blk == b
            out[m] = self._gather(int(b), loc[m], keys=(key,))[key]
        return from_storage_np(out, col.dtype)

    # -- checkpointing / pickling ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "backend": self.backend, "format_version": FORMAT_VERSION,
                "init_args": self._init_args, "rows": len(self), "groups": len(self._groups)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if Path(state_dict["path"]).absolute() != self.path:
            self.close()
            self.__setstate__({"path": state_dict["path"], "init_args": state_dict["init_args"]})

    def dumps(self, path) -> None:
        import json
        Path(path).mkdir(parents=True, exist_ok=True)
        self.flush_catalog()
        (Path(path) / "storage_state.json").write_text(json.dumps(self.state_dict()))

    def loads(self, path) -> None:
        import json
        self.load_state_dict(json.loads((Path(path) / "storage_state.json").read_text()))

    def __getstate__(self) -> dict:
        if os.getpid() == self._pid and self._catalog is not None:
            self._maintain("catalogue", self._catalog.flush)
        return {"path": str(self.path), "init_args": self._init_args}

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, state["path"], **dict(state["init_args"], create=False))

    def _empty(self) -> None:
        """``ReplayBuffer.empty()``: evict every committed group."""
        if self._ledger.evict_all():
            self._backend.after_evict()
        self._take_view()

    def __repr__(self) -> str:
        self._refresh()  # (not len(): showing a store must not renumber the reads of its drawn rows)
        rows, groups = self._ledger.index.rows, len(self._groups)
        return f"{type(self).__name__}(path={str(self.path)!r}, rows={rows}, groups={groups})"

    def compact(self) -> int:
        """Rewrite the live groups of sealed segments into one block; returns the number of groups moved
        (0 for a backend that does not compact, e.g. Zarr, whose rows are addressable one by one).

        Random-row reads then touch one block. Writers are not blocked. The backend's maintenance lock is held
        while the groups are read, and again from publishing the new block until the old files are deleted;
        evictors delete no file while it is held (the new block is unreferenced until the ``move`` record, and
        the old ones are being read). Writing and fsyncing the new block, the slow part, runs without it, so
        evictions meanwhile still free the disk (docs/FORMAT.md, "Retention and disk"); groups evicted or moved
        by another compaction meanwhile are not moved.
        """
        backend = self._backend
        if not backend.compacts:
            return 0
        with backend.maintenance_lock():
            self._refresh()
            recs = backend.compactable() if self._schema is not None else []
            if not recs:
                return 0
            parts, rows = [], 0
            for r in recs:
                first = r["loc"]["row"]
                parts.append(self._gather(backend.block_id(r["loc"], r["n"]), np.arange(first, first + r["n"])))
                rows += r["n"]
        name, loc = backend.write_compacted(parts, rows)
        moves, published = [], False
        try:
            with backend.maintenance_lock():
                self._refresh()
                row = 0
                for r in recs:
                    if self._ledger.groups.get(r["seq"], {}).get("loc") == r["loc"]:  # still live, still there
                        moves.append([r["seq"], dict(loc, row=row)])
                    row += r["n"]
                if moves:
                    backend.publish_compacted(name)
                    published = True
                    self._ledger.move(moves)
                    backend.after_compaction(recs, name)
        finally:
            if not published:
                backend.discard_compacted(name)
        return len(moves)

    # -- the backend, for the read paths and tests ----------------------------------------------------------
    def _gather(self, block: int | None, local_rows: np.ndarray, keys=None) -> dict:
        return self._backend.gather(block, local_rows, keys)

    def _seal(self) -> None:
        self._backend.seal()

    def _after_fork(self) -> None:
        self._pid = os.getpid()
        self._catalog = None  # the parent's pending rows are the parent's to flush
        self._pins.clear()  # the parent's draws are the parent's to read
        self._backend.after_fork()

    def check_tail(self) -> dict:
        """Data on disk that no commit names (never served): the commit log's torn lines, and the backend's."""
        return self._backend.check_tail(self._ledger.tail())


register_default_collate(GroupStorage)
