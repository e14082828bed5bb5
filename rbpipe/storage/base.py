"""What both backends share: the commit protocol, row/group bookkeeping, reads, retention, pickling.

Rows are numbered by *position* among the live groups in commit order: row 0 is the first row of the
oldest group not evicted. Evicting groups therefore shifts every later row index down by the number of
rows evicted (``group_spans()`` always reports current positions; its sequence numbers never change).
Backends only write a group's columns somewhere and gather rows back (``_write_group``/``_gather``).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, TensorDictBase
from torchrl.data.replay_buffers.storages import Storage

from rbpipe.procs import pid_alive  # noqa: F401 - re-exported for storage modules
from rbpipe.errors import SchemaError, StaleReadError, StoreError
from rbpipe.schema import (ADVANTAGE_KEY, COLLECTOR_KEY, GROUP_KEY, RESPONSE_TOKENS_KEY, REWARD_KEY,
                           VERSION_KEY)
from rbpipe.storage.collate import register_default_collate
from rbpipe.storage.commitlog import CommitLog
from rbpipe.storage.gather import concat_tables, pad_ragged, whole_groups
from rbpipe.storage.format import COMMIT_LOG, FORMAT_VERSION, create_or_open
from rbpipe.storage.group_index import GroupIndex
from rbpipe.storage.layout import (GroupColumns, Schema, decode_texts, from_storage_np, jagged_tensor, key_tuple,
                                   row_elements, take_ragged)

NestedKey = Any
UNBOUNDED = torch.iinfo(torch.int64).max

DEFAULT_CATALOG_COLUMNS: dict[str, tuple[NestedKey, str]] = {
    "returns": (REWARD_KEY, "value"),
    "advantages": (ADVANTAGE_KEY, "value"),
    "collectors": (COLLECTOR_KEY, "value"),
    "policy_versions": (VERSION_KEY, "value"),
    "lengths": (RESPONSE_TOKENS_KEY, "length"),
}



def writer_id() -> str:
    """Name of this process's segment: host, pid and a random part (a restarted pid gets a new one)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


RAGGED_LAYOUTS = ("rows", "padded", "nested")


class GroupStorage(Storage):
    """Base class of :class:`ArrowStorage` and :class:`ZarrStorage` (see their docs)."""

    backend = ""

    def __init__(self, path: str | os.PathLike, *, max_size: int | None = None, max_bytes: int | None = None,
                 ragged_keys: Sequence[NestedKey] = (), group_key: NestedKey = GROUP_KEY,
                 catalog_columns: Mapping[str, tuple[NestedKey, str]] | None = None, create: bool = True,
                 catalog_every: int = 256, catalog_interval_s: float = 5.0,
                 ragged_layout: str | None = None) -> None:
        if max_size is not None and max_size < 1:
            raise StoreError(f"max_size must be a positive number of rows or None, got {max_size}")
        super().__init__(max_size=UNBOUNDED if max_size is None else max_size)
        self._init_args = dict(max_size=max_size, max_bytes=max_bytes,
                               ragged_keys=[list(key_tuple(k)) for k in ragged_keys], group_key=group_key,
                               catalog_columns=None if catalog_columns is None else
                               {k: (list(key_tuple(v[0])), v[1]) for k, v in catalog_columns.items()},
                               create=create, catalog_every=catalog_every,
                               catalog_interval_s=catalog_interval_s, ragged_layout=ragged_layout)
        if ragged_layout is not None and ragged_layout not in RAGGED_LAYOUTS:
            raise StoreError(f"ragged_layout must be one of {', '.join(map(repr, RAGGED_LAYOUTS))}, "
                             f"got {ragged_layout!r}")
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
        # a parquet file per `catalog_every` groups, or sooner once its oldest row waited `catalog_interval_s`:
        # few, large files (a flush costs ~10 ms) without letting a slow writer's catalogue fall far behind
        self.catalog_every, self.catalog_interval_s = catalog_every, catalog_interval_s
        self.meta = create_or_open(self.path, self.backend, create=create,
                                   options={"ragged_keys": self._init_args["ragged_keys"]})
        self._log = CommitLog(self.path / COMMIT_LOG)
        self._schema: Schema | None = None
        self._groups: OrderedDict[int, dict] = OrderedDict()  # seq -> group record, in commit order
        self._gindex = GroupIndex()  # row positions of the live groups
        self._live_bytes = 0
        self._commit_ids: set[str] = set()  # ids of committed groups (idempotent recovery writes)
        self._member_ids: set[str] = set()  # writer-supplied ids of committed rows (e.g. staging handles)
        self._evicted_upto = -1
        self._pid = os.getpid()
        self._pending_catalog: list[dict] = []
        self._open_backend()
        self._refresh()
        self.torn_tail = self.check_tail()

    # -- commit-log state -------------------------------------------------------------------------------
    def _apply(self, records: list[dict]) -> None:
        for rec in records:
            kind = rec.get("t")
            if kind == "schema" and self._schema is None:
                self._schema = Schema.from_json(rec["schema"])
                self._on_schema(self._schema)
            elif kind == "group":
                if self._schema is None:
                    raise self._no_schema_error()
                if "cid" in rec:
                    self._commit_ids.add(rec["cid"])
                self._member_ids.update(rec.get("mids", ()))
                self._on_commit(rec)
                if rec["seq"] <= self._evicted_upto:
                    continue
                self._groups[rec["seq"]] = rec
                self._gindex.append(rec["seq"], rec["n"], self._block_id(rec["loc"], rec["n"]),
                                    rec["loc"].get("row", 0))
                self._live_bytes += rec["bytes"]
                self._on_live(rec["loc"], 1)
            elif kind == "evict":
                self._evicted_upto = max(self._evicted_upto, rec["upto"])
                while self._groups and next(iter(self._groups)) <= rec["upto"]:
                    gone = self._groups.popitem(last=False)[1]
                    self._live_bytes -= gone["bytes"]
                    self._on_live(gone["loc"], -1)
                self._gindex.evict_upto(rec["upto"])
            elif kind == "move":
                for seq, loc in rec["groups"]:
                    if int(seq) in self._groups:
                        self._on_live(loc, 1)
                        self._on_live(self._groups[int(seq)]["loc"], -1)
                        self._groups[int(seq)] = dict(self._groups[int(seq)], loc=loc)
                self._gindex.relocate(lambda seq: (self._block_id(self._groups[seq]["loc"], self._groups[seq]["n"]),
                                                   self._groups[seq]["loc"].get("row", 0)))
                self._on_move(rec)

    def _no_schema_error(self) -> StoreError:
        """A group line with no valid schema line before it: the schema line was damaged after it was written
        (a writer killed mid-line is followed by a new schema line). Serving the store would say it is empty
        while groups are committed, and the next write would commit a second, possibly different, schema."""
        where = ("every segment's Arrow schema metadata 'rbpipe.schema'" if self.backend == "arrow"
                 else "the 'schema' attribute of data.zarr/zarr.json")
        return StoreError(f"the commit log {str(self.path / COMMIT_LOG)!r} has committed groups but its schema line "
                          f"is unreadable ({self._log.torn_lines} damaged line(s)); restore {COMMIT_LOG} from a "
                          f"backup (a copy of the schema is in {where}) before using this store")

    def _write_error(self, err: OSError) -> StoreError:
        """A failed write in plain words; what was half-written is unreachable (no commit line)."""
        import errno

        why = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exhausted",
               errno.EROFS: "the store is on a read-only file system",
               errno.EACCES: "permission denied"}.get(err.errno, str(err))
        return StoreError(f"could not write a group to the store {self.path}: {why}. Nothing of this group was "
                          "committed and the groups already stored are intact; free space / make the store "
                          "writable, then retry (or write to another --store)")

    def committed_member_ids(self) -> set[str]:
        """Every ``member_ids`` entry ever committed (evicted groups included): lets a recovering writer
        tell which of its pending items already reached the store."""
        self._refresh()
        return set(self._member_ids)

    def _refresh(self) -> None:
        self._apply(self._log.read_new())

    def _index(self) -> tuple[np.ndarray, ...]:
        """Arrays over live groups in commit order: seq, first row, stop row, block id, local row start."""
        return self._gindex.arrays()

    def __len__(self) -> int:
        self._refresh()
        return self._gindex.rows

    def group_spans(self) -> torch.Tensor:
        """``[n_groups, 3]`` int64: (commit sequence number, first row, stop row) of live groups, oldest first."""
        self._refresh()
        seqs, starts, stops = self._index()[:3]
        return torch.from_numpy(np.stack([seqs, starts, stops], 1) if len(seqs) else np.zeros((0, 3), np.int64))

    @property
    def ragged_layout(self) -> str:
        """The layout reads use: as asked, else ``"nested"`` when every ragged field is 1-D and real (the one
        that samples at memmap speed: one values tensor and offsets per field), else ``"rows"``."""
        if self._layout_asked is not None:
            return self._layout_asked
        if self._schema is None:
            return "nested"
        return "nested" if all(c.ndim == 1 and not c.complex for c in self._schema.columns if c.ragged) else "rows"

    @property
    def schema(self) -> Schema | None:
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
        (opaque strings naming what this commit consumed, e.g. staged payloads) are recorded with it: see :meth:`committed_member_ids`.
        """
        if os.getpid() != self._pid:
            self._after_fork()
        self._refresh()
        if self._schema is None:
            candidate = Schema.infer(td, self.ragged_keys)
            self._log.append(lambda seq: None if self._schema is not None else
                             {"t": "schema", "schema": candidate.to_json(), "time": time.time()}, self._apply)
        cols = self._schema.split(td)  # raises SchemaError before anything is written
        try:
            loc, nbytes = self._write_group(cols)
        except OSError as err:
            raise self._write_error(err) from err
        cat = self._catalog_values(cols)
        gid = None
        if self.group_key in cols.fixed and cols.fixed[self.group_key].size:
            gid = cols.fixed[self.group_key].reshape(-1)[0].item()
        def make(seq):
            if commit_id is not None and commit_id in self._commit_ids:
                return None  # already committed by a writer that died before confirming it
            return {"t": "group", "n": cols.n, "loc": loc, "bytes": nbytes, "time": time.time(), "gid": gid,
                    "cat": cat, "writer": self._writer_name(), **({"cid": commit_id} if commit_id else {}),
                    **({"mids": list(member_ids)} if member_ids else {})}

        try:
            rec = self._log.append(make, self._apply)
        except OSError as err:
            raise self._write_error(err) from err
        if rec is None:
            return torch.zeros(0, dtype=torch.int64)
        self._pending_catalog.append(rec)
        self._retain()
        if (len(self._pending_catalog) >= self.catalog_every
                or rec["time"] - self._pending_catalog[0]["time"] >= self.catalog_interval_s):
            self.flush_catalog()
        start = self._gindex.start_of(rec["seq"])
        if start is None:  # evicted at once (larger than max_size/max_bytes)
            return torch.zeros(0, dtype=torch.int64)
        self._bump_mutation_revision()
        return torch.arange(start, start + cols.n)

    def _retain(self) -> None:
        """Evict the oldest groups beyond ``max_size``/``max_bytes`` and free their files (the disk bound of
        docs/FORMAT.md, "Retention and disk", holds after every commit)."""
        self._after_commit()
        if self.max_size == UNBOUNDED and self.max_bytes is None:
            return

        def over(rows: int, nbytes: int) -> bool:
            return rows > self.max_size or (self.max_bytes is not None and nbytes > self.max_bytes)

        def make(seq):
            rows, nbytes, upto = self._gindex.rows, self._live_bytes, None
            for i, r in enumerate(self._groups.values()):  # oldest first; always keep the newest group
                if i == len(self._groups) - 1 or not over(rows, nbytes):
                    break
                rows -= r["n"]
                nbytes -= r["bytes"]
                upto = r["seq"]
            return None if upto is None else {"t": "evict", "upto": upto, "time": time.time()}

        if over(self._gindex.rows, self._live_bytes):
            self._log.append(make, self._apply)
            self._after_evict()

    def _catalog_values(self, cols: GroupColumns) -> dict[str, list]:
        from rbpipe.storage.catalog import json_numbers, summable

        out = {}
        for name, (key, red) in self.catalog_columns.items():
            if key in cols.fixed:
                a = summable(cols.fixed[key], self._schema.by_key[key].dtype)
                if red == "value":
                    wide = np.float64 if a.dtype.kind == "f" else None  # float16 sums overflow in float16
                    out[name] = a.reshape(cols.n, -1).sum(1, dtype=wide).tolist()
                else:
                    shape = self._schema.by_key[key].shape
                    out[name] = [shape[0] if shape else 1] * cols.n
            elif key in cols.ragged:
                values, shapes = cols.ragged[key]
                if red == "length":
                    out[name] = shapes[:, 0].tolist() if shapes.shape[1] else [1] * cols.n
                else:
                    sizes = row_elements(shapes)
                    flat = summable(values.reshape(-1), self._schema.by_key[key].dtype)
                    sizes = sizes * (flat.size // max(int(sizes.sum()), 1))
                    csum = np.concatenate([[0], np.cumsum(flat, dtype=np.float64 if flat.dtype.kind == "f"
                                                          else np.int64)])
                    ends = np.cumsum(sizes)
                    out[name] = (csum[ends] - csum[ends - sizes]).tolist()
        return {name: json_numbers(v) for name, v in out.items()}

    def set(self, cursor, data, *, set_cursor: bool = True):
        """torchrl writer entry point. The store is append-only: only the rows right after the last one may
        be written (one new group); any other position (a slice included) is refused before anything is
        written, since silently appending would put the data somewhere the caller did not ask for."""
        from rbpipe.storage.layout import check_group

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
        if self._pending_catalog:
            from rbpipe.storage.catalog import write_catalog_rows
            write_catalog_rows(self.path, self._pending_catalog, self.catalog_columns)
            self._pending_catalog = []

    def close(self) -> None:
        """Flush the catalogue and seal this process's segment (readers keep working)."""
        if os.getpid() == self._pid:
            self.flush_catalog()
            self._seal()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- reads --------------------------------------------------------------------------------------------
    def _rows(self, index) -> tuple[np.ndarray, bool]:
        """``index`` as int64 rows (and whether it was a scalar). Integer tensors and arrays (what samplers
        hand over) are read against the rows known at the last refresh, which ``len()`` does and a sampler
        calls before it draws: an eviction in between does not shift the drawn rows under it. A row past
        that snapshot, or any other kind of index, refreshes first."""
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        if isinstance(index, (torch.Tensor, np.ndarray)) and index.ndim == 1:
            if type(index) is torch.Tensor and index.dtype == torch.int64:
                rows = index.numpy()  # a view, no conversion
            else:
                rows = np.asarray(torch.as_tensor(index).numpy(), dtype=np.int64)
            if not rows.size or rows.view(np.uint64).max() < self._gindex.rows:  # one pass: negatives read huge
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

    def _gather_rows(self, rows: np.ndarray) -> dict[tuple, Any]:
        """Columns of ``rows``: fixed ones as one array, ragged ones as a list of (flat values, shapes)
        parts in row order. Parts are views of the mapped segments where possible: concatenating them
        here would allocate (and page-fault in) a fresh buffer on every sample."""
        one = self._gindex.one_block()
        if one is not None and rows.size:  # a compacted store: one gather, no per-row block lookup
            parts = [self._gather(one[0], rows + one[1])]
            return {c.key: [p[c.key] for p in parts] if c.ragged else parts[0][c.key] for c in self._schema.columns}
        seqs, starts, stops, blocks, local = self._index()
        groups = whole_groups(rows, starts, stops)
        if groups is not None and len(groups) > 1:  # whole groups (what GRPO samples) of whole blocks: one
            # multi-threaded copy (a single group is returned as views of its block below, without a copy)
            n = stops[groups] - starts[groups]
            tables = [self._whole_table(b, a, a + k)
                      for b, a, k in zip(blocks[groups].tolist(), local[groups].tolist(), n.tolist())]
            if None not in tables:
                out = concat_tables(self._schema.columns, tables, len(rows))
                if out is not None:
                    return out
        g = np.searchsorted(stops, rows, side="right")
        blk = blocks[g]
        loc = rows - starts[g] + local[g]
        if rows.size == 0:
            parts, inv = [self._gather(None, loc)], None
        else:
            # runs of consecutive rows of one block (e.g. whole groups): one slice per column each
            runs = np.flatnonzero((np.diff(blk) != 0) | (np.diff(loc) != 1)) + 1
            if len(runs) < 64:
                first, last = np.concatenate(([0], runs)), np.concatenate((runs, [len(rows)])) - 1
                spans = zip(blk[first].tolist(), loc[first].tolist(), (loc[last] + 1).tolist())
                parts = [self._slice(b, a, z) for b, a, z in spans]
                inv = None
            elif (blk == blk[0]).all():  # scattered rows of one block (a compacted store): one gather
                parts, inv = [self._gather(int(blk[0]), loc)], None
            else:  # scattered rows: one gather per block, then back to the order asked for
                order = np.argsort(blk, kind="stable")
                sorted_blk = blk[order]
                cuts = np.flatnonzero(np.diff(sorted_blk)) + 1
                parts = [self._gather(int(sorted_blk[s]), loc[order[s:e]])
                         for s, e in zip(np.r_[0, cuts], np.r_[cuts, len(order)])]
                inv = np.argsort(order)
        out: dict[tuple, Any] = {}
        for c in self._schema.columns:
            if c.ragged:
                out[c.key] = [p[c.key] for p in parts]
                if inv is not None:
                    out[c.key] = [take_ragged(*_concat(out[c.key]), c, inv)]
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
        ``("lengths", *key)``."""
        rows, scalar = self._rows(index)
        if self._schema is None:
            raise IndexError("the store is empty")
        data = self._read_snapshot(self._gather_rows, rows)
        td = self._to_td(data, len(rows))
        return td[0] if scalar else td

    def _to_td(self, data: dict, m: int) -> TensorDictBase:
        """Columns -> TensorDict, assembled without validation (shapes and dtypes come from the store's
        schema): ``TensorDict(...)`` checks every leaf, and in the rows layout ``unbind`` plus per-row ``set``
        cost about 25 us a row, which dominated sampling."""
        cols = self._schema.columns
        layout = self.ragged_layout
        fixed = {c.key: from_storage_np(data[c.key], c.dtype) for c in cols if not c.ragged}
        texts = {c.key: decode_texts(data[c.key]) for c in cols if c.text}
        if layout == "padded":
            for c in cols:
                if c.ragged and not c.text:
                    fixed[c.key], fixed[("lengths", *c.key)] = _pad(data[c.key], c, m)
        elif layout == "nested":
            offsets: dict[bytes, torch.Tensor] = {}  # fields with equal row lengths share one ragged dim
            for c in cols:
                if c.ragged and not c.text:
                    fixed[c.key] = _jagged(data[c.key], c, m, offsets)
        if not self._schema.has_ragged or layout != "rows" or m == 0:
            for key, values in texts.items():  # string columns: one str per row
                fixed[key] = NonTensorStack.from_list(values) if m else NonTensorStack(batch_size=[0])
            return _dense_td(_nest(fixed), torch.Size([m]))
        per_row = {key: t.unbind(0) for key, t in fixed.items()}
        for key, values in texts.items():
            per_row[key] = [NonTensorData(v, batch_size=_NO_BATCH) for v in values]
        for c in cols:
            if c.ragged and not c.text:
                per_row[c.key] = _ragged_rows(data[c.key], c)
        return LazyStackedTensorDict(*_row_tensordicts(_nest(per_row), m), stack_dim=0)

    def _read_snapshot(self, read, rows: np.ndarray):
        """``read(rows)``, where ``rows`` number the live groups of the last refresh. If a file is gone, a
        compaction moved those groups (refresh: they are read where they are now) or an eviction deleted
        them (:class:`StaleReadError`): never the same row numbers under a newer numbering, which would be
        other groups."""
        for _ in range(3):
            try:
                return read(rows)
            except FileNotFoundError:
                rows = self._remap(rows)
        raise StaleReadError(f"the groups read from {self.path} kept moving (compactions); draw again")

    def _remap(self, rows: np.ndarray) -> np.ndarray:
        """Refresh, and return where the groups of ``rows`` (numbered before it) are now; StaleReadError
        when one of them was evicted since."""
        seqs, starts, stops = self._index()[:3]
        g = np.searchsorted(stops, rows, side="right")
        want, offset = seqs[g], rows - starts[g]
        self._refresh()
        seqs, starts = self._index()[:2]
        i = np.minimum(np.searchsorted(seqs, want), max(len(seqs) - 1, 0))
        if not len(seqs) or (seqs[i] != want).any():
            raise StaleReadError(f"rows drawn from {self.path} belong to groups evicted (and deleted) since; "
                                 "refresh (len(storage)) and draw again")
        return starts[i] + offset

    def hold(self, index) -> None:
        """Open every file ``get(index)`` reads, at the current view (no refresh), so that that read needs
        no file an evictor may delete meanwhile: a sampler calls it before handing ``index`` out and draws
        again on :class:`StaleReadError`. Costs nothing extra: ``get`` reuses what this opened."""
        rows, _ = self._rows(index)
        if not rows.size or self._schema is None:
            return
        stops, blocks = self._index()[2:4]
        for b in np.unique(blocks[np.searchsorted(stops, rows, side="right")]).tolist():
            try:
                self._hold_block(b)
            except FileNotFoundError as err:
                raise StaleReadError(f"rows drawn from {self.path} belong to groups evicted (and deleted) "
                                     "since; refresh (len(storage)) and draw again") from err

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
        return self._read_snapshot(lambda r: self._read_column(col, r), r)

    def _read_column(self, col, r: np.ndarray) -> torch.Tensor:
        key = col.key
        seqs, starts, stops, blocks, local = self._index()
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
        if os.getpid() == self._pid:
            self.flush_catalog()
        return {"path": str(self.path), "init_args": self._init_args}

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, state["path"], **dict(state["init_args"], create=False))

    def _empty(self) -> None:
        """``ReplayBuffer.empty()``: evict every committed group."""
        self._refresh()
        if self._groups:
            last = max(self._groups)
            self._log.append(lambda seq: {"t": "evict", "upto": last, "time": time.time()}, self._apply)
            self._after_evict()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={str(self.path)!r}, rows={len(self)}, groups={len(self._groups)})"

    # -- backend hooks ------------------------------------------------------------------------------------
    def _open_backend(self) -> None: ...
    def _on_schema(self, schema: Schema) -> None: ...
    def _on_move(self, rec: dict) -> None: ...
    def _after_evict(self) -> None: ...
    def _after_commit(self) -> None:
        """After each commit (Arrow seals a segment that reached its size when the store evicts)."""
    def _on_commit(self, rec: dict) -> None:
        """Every group record, evicted or not (what was ever written where)."""
    def _on_live(self, loc: dict, delta: int) -> None:
        """A live group arrived at (+1) or left (-1) ``loc``: readers let go of files with no live group."""
    def _hold_block(self, block: int) -> None:
        """Open (map, or read into the cache) what ``_gather`` reads for ``block``."""
    def _after_fork(self) -> None:
        self._pid = os.getpid()
        self._pending_catalog = []
    def _seal(self) -> None: ...
    def _writer_name(self) -> str:
        return f"{socket.gethostname()}-{os.getpid()}"
    def check_tail(self) -> dict:
        return {"torn_commit_lines": self._log.torn_lines, "unterminated_commit_bytes": self._log.pending_bytes}
    def _block_id(self, loc: dict, n: int) -> int:
        """Id of the unit ``_gather`` reads from (a record batch, a group...) for a group at ``loc``."""
    def _write_group(self, cols: GroupColumns) -> tuple[dict, int]: ...
    def _gather(self, block: int | None, local_rows: np.ndarray, keys=None) -> dict: ...
    def _slice(self, block: int, first: int, stop: int, keys=None) -> dict:
        """Columns of the consecutive rows ``first..stop`` of one block (backends override it with views)."""
        return self._gather(block, np.arange(first, stop), keys)

    def _whole_table(self, block: int, first: int, stop: int) -> dict | None:
        """The decoded table of ``block`` (as ``take_columns`` reads it) when rows ``first..stop`` are all of
        it, else None: whole blocks are copied by ``gather.concat_tables``."""
        return None


def _concat(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged parts -> one (flat values, shapes)."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([v for v, _ in parts]), np.concatenate([s for _, s in parts])


def _pad(parts: list[tuple[np.ndarray, np.ndarray]], col, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged parts -> (``[m, *longest]`` tensor right-padded with zeros, first-dim lengths ``[m]``)."""
    trail = (2,) if col.complex else ()
    if col.ndim == 1 and len(parts) == 1:  # one part (e.g. whole groups): rows padded in parallel
        values, shapes = parts[0]
        out = pad_ragged(values, shapes[:, 0], trail, col.np_dtype)
        if out is not None:
            return from_storage_np(out, col.dtype), torch.from_numpy(shapes[:, 0].copy())
    all_shapes = np.concatenate([s for _, s in parts]) if parts else np.zeros((0, col.ndim), np.int64)
    top = tuple(int(x) for x in all_shapes.max(0)) if m else (0,) * col.ndim
    out = np.zeros((m, *top, *trail), col.np_dtype)
    i = 0
    for values, shapes in parts:  # a loop of slice copies: faster than one flat fancy-index scatter
        elems = values.reshape(-1, *trail)
        pos = 0
        for shape, k in zip(shapes.tolist(), row_elements(shapes).tolist()):
            if col.ndim == 1:
                out[i, :k] = elems[pos:pos + k]
            else:
                out[(i, *(slice(0, s) for s in shape))] = elems[pos:pos + k].reshape(*shape, *trail)
            pos += k
            i += 1
    lengths = torch.from_numpy(all_shapes[:, 0].copy()) if col.ndim else torch.ones(m, dtype=torch.int64)
    return from_storage_np(out, col.dtype), lengths


def _ragged_rows(parts: list[tuple[np.ndarray, np.ndarray]], col) -> list[torch.Tensor]:
    """Ragged parts -> one tensor per row (views of one tensor per part)."""
    trail = (2,) if col.complex else ()
    out: list[torch.Tensor] = []
    for values, shapes in parts:
        flat = from_storage_np(values.reshape(-1, *trail), col.dtype)
        pieces = flat.split(row_elements(shapes).tolist())
        out += pieces if col.ndim == 1 else [t.view(shape) for t, shape in zip(pieces, shapes.tolist())]
    return out


_NO_BATCH = torch.Size([])


def _row_tensordicts(tree: dict, m: int) -> list[TensorDict]:
    """``{name: per-row sequence | subtree}`` -> ``m`` row TensorDicts (``batch_size=[]``), nested like
    ``tree``; every leaf is trusted (shapes and dtypes come from the store's schema)."""
    names, columns = [], []
    for name, child in tree.items():  # column-wise, bottom-up: the per-row work is one zip and one call
        names.append(name)
        columns.append(_row_tensordicts(child, m) if isinstance(child, dict) else child)
    new = TensorDict._new_unsafe
    return [new(dict(zip(names, row)), _NO_BATCH, nested=False) for row in zip(*columns)]


def _jagged(parts: list[tuple[np.ndarray, np.ndarray]], col, m: int,
            offsets_by_lengths: dict[bytes, torch.Tensor]) -> torch.Tensor:
    """Ragged parts -> one jagged ``torch.nested`` tensor ``[m, j]`` (one values tensor plus offsets).

    Fields whose rows have equal lengths (tokens and their log-probs) get the very same offsets tensor, so
    they share one ragged dimension: ``a * b`` works across them, and the second NJT is cheaper to build."""
    if col.ndim != 1 or col.complex:
        raise SchemaError(f"ragged_layout='nested' holds 1-D real ragged fields only; {'.'.join(col.key)!r} is "
                          f"{col.ndim}-D {col.dtype}: open the store with ragged_layout='padded' or 'rows'")
    if m == 0:
        return torch.zeros(0, 0, dtype=getattr(torch, col.dtype))
    values, shapes = _concat(parts)
    values = from_storage_np(values.reshape(-1), col.dtype)
    lengths = np.ascontiguousarray(shapes[:, 0])
    offsets = offsets_by_lengths.get(lengths.tobytes())
    if offsets is None:
        cum = np.empty(m + 1, np.int64)
        cum[0] = 0
        np.cumsum(lengths, out=cum[1:])
        offsets = offsets_by_lengths[lengths.tobytes()] = torch.from_numpy(cum)
    return jagged_tensor(values, offsets)


def _dense_td(tree: dict, batch_size: torch.Size) -> TensorDict:
    """``{name: tensor | subtree}`` -> a TensorDict, unvalidated (every leaf comes from the schema)."""
    return TensorDict._new_unsafe({k: _dense_td(v, batch_size) if isinstance(v, dict) else v
                                   for k, v in tree.items()}, batch_size, nested=False)


def _nest(d: dict) -> dict:
    out: dict = {}
    for key, v in d.items():
        cur = out
        for part in key[:-1]:
            cur = cur.setdefault(part, {})
        cur[key[-1]] = v
    return out


register_default_collate(GroupStorage)
