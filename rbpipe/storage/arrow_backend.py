"""``ArrowBackend``: the default store's bytes. Arrow IPC stream segments, one record batch per group.

Each writer process appends to its own segment file (``segments/<host>-<pid>-<rand>.arrows.inprogress``,
renamed to ``.arrows`` when sealed), so concurrent writers never share a file. Batches are read back
memory-mapped copy-on-write: zero-copy, and an in-place edit of a sampled tensor never reaches the file.
``compact()`` rewrites the sealed segments' live groups into one batch (``write_compacted``), after which random-row
sampling is a single numpy gather per column.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from rbpipe.errors import StoreError
from rbpipe.storage.backend import Backend, writer_id
from rbpipe.storage.columns import Column, ColumnSet, GroupColumns, empty_columns, slice_columns, take_columns
from rbpipe.storage.format import SEGMENTS_DIR
from rbpipe.storage.retention import BLOCK, owner_alive, roll_bytes
from rbpipe.system.fsutil import file_lock, write_file
from rbpipe.system.procs import pid_alive

SEALED = ".arrows"
IN_PROGRESS = ".arrows.inprogress"
EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def _pa_type(c: Column) -> pa.DataType:
    return pa.from_numpy_dtype(c.np_dtype)


def arrow_schema(schema: ColumnSet) -> pa.Schema:
    """The Arrow schema of a store's segments (FORMAT.md, "Arrow segments")."""
    fields = []
    for c in schema.columns:
        t = _pa_type(c)
        if c.shape is None:  # ragged
            fields.append(pa.field(c.name, pa.large_string() if c.text else pa.large_list(t), nullable=False))
            fields.append(pa.field(c.name + ".__shape", pa.list_(pa.int64(), c.ndim), nullable=False))
        else:
            width = int(np.prod(c.shape)) * (2 if c.complex else 1)
            if c.shape == () and not c.complex:
                fields.append(pa.field(c.name, t, nullable=False))
            else:
                fields.append(pa.field(c.name, pa.list_(t, width), nullable=False))
    import json
    return pa.schema(fields, metadata={"rbpipe.schema": json.dumps(schema.to_json())})


def to_record_batch(cols: GroupColumns, schema: ColumnSet, pschema: pa.Schema) -> pa.RecordBatch:
    """A group's columns as one record batch, built from their buffers without copies or per-array
    validation (the types come from ``pschema``; ``pa.array`` + ``from_arrays`` cost a large part of a write;
    figures: docs/DESIGN.md, Figures behind code choices)."""
    arrays = []
    fields = iter(pschema)
    n = cols.n
    for c in schema.columns:
        t = next(fields).type
        if c.ragged:
            values, shapes = cols.ragged[c.key]
            flat = np.ascontiguousarray(values).reshape(-1)
            offsets = np.zeros(n + 1, np.int64)
            if c.ndim == 1 and not c.complex:
                np.cumsum(shapes[:, 0], out=offsets[1:])
            elif c.ndim:
                np.cumsum(shapes.prod(1) * (2 if c.complex else 1), out=offsets[1:])
            else:
                offsets[1:] = np.arange(1, n + 1) * (2 if c.complex else 1)
            if c.text:  # large_string: int64 offsets and the UTF-8 bytes, the same buffers as a byte list
                arrays.append(pa.Array.from_buffers(t, n, [None, pa.py_buffer(offsets), pa.py_buffer(flat)]))
            else:
                arrays.append(pa.Array.from_buffers(t, n, [None, pa.py_buffer(offsets)],
                                                    children=[_flat_array(t.value_type, flat)]))
            shape_type = next(fields).type
            arrays.append(pa.Array.from_buffers(shape_type, n, [None], children=[
                _flat_array(shape_type.value_type, np.ascontiguousarray(shapes, np.int64).reshape(-1))]))
        else:
            flat = np.ascontiguousarray(cols.fixed[c.key]).reshape(-1)
            if pa.types.is_fixed_size_list(t):
                arrays.append(pa.Array.from_buffers(t, n, [None], children=[_flat_array(t.value_type, flat)]))
            else:
                arrays.append(_flat_array(t, flat))
    return pa.RecordBatch.from_arrays(arrays, schema=pschema)


def _flat_array(t: pa.DataType, a: np.ndarray) -> pa.Array:
    """A primitive Arrow array over a contiguous 1-D numpy array's memory (no copy)."""
    return pa.Array.from_buffers(t, a.size, [None, pa.py_buffer(a)])


class _Segment:
    """A copy-on-write memory map of one segment file, remapped when the file has grown."""

    def __init__(self, path: Path):
        self.path = path
        self.mm: mmap.mmap | None = None
        self.base = 0
        self.size = 0

    def buffer(self, end: int):
        if self.mm is None or end > self.size:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                self.mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            finally:
                os.close(fd)
            self.size = len(self.mm)
            self.bytes = np.frombuffer(self.mm, np.uint8)
            self.base = self.bytes.ctypes.data
            self.pabuf = pa.py_buffer(self.mm)
        return self


class ArrowBackend(Backend):
    """Group bytes in Arrow IPC segments (see the module doc and docs/FORMAT.md, "Arrow segments")."""

    name = "arrow"
    schema_copy = "every segment's Arrow schema metadata 'rbpipe.schema'"
    compacts = True
    whole_tables = True

    def __init__(self, path: Path, ledger, *, evicts: bool) -> None:
        super().__init__(path, ledger, evicts=evicts)
        self._seg_dir = self.path / SEGMENTS_DIR
        self._seg_dir.mkdir(exist_ok=True)
        self._segments: dict[str, _Segment] = {}
        self._blocks: dict[tuple, int] = {}
        self._block_locs: list[tuple] = []
        self._views: dict[int, dict] = {}
        self._wholes: dict[int, tuple[int, dict]] = {}  # block -> (rows, its columns as _slice returns them)
        self._pschema: Any = None  # pa.Schema, from on_schema
        self._stream: pa.ipc.RecordBatchStreamWriter | None = None  # this process's open segment
        self._sink: pa.OSFile | None = None
        self._wname: str | None = None
        self._wpos = 0
        self._wbatches = 0
        self._seg_live: dict[str, int] = {}  # segment -> live groups in it
        self._seg_end: dict[str, int] = {}  # segment -> end of its last committed batch (evicted ones too)
        self._swept = True  # no segment lost its last live group since the last sweep
        self._evictions = 0

    def on_schema(self, schema: ColumnSet) -> None:
        super().on_schema(schema)
        self._pschema = arrow_schema(schema)

    # -- writing ------------------------------------------------------------------------------------------
    def write_group(self, cols: GroupColumns) -> tuple[dict, int]:
        batch = to_record_batch(cols, self.schema, self._pschema)
        if self._stream is None:
            self._open_segment()
        stream, sink = self._stream, self._sink
        assert stream is not None and sink is not None  # (opened just now if they were not)
        try:  # the IPC writer copies the columns straight into the file: no serialised copy in between
            stream.write_batch(batch)
            end = sink.tell()
            if self._wbatches == 0:  # the writer puts the schema message before its first batch
                self._wpos += self._pschema.serialize().size
        except OSError:
            self.seal(failed=True)  # cut the partial batch off; the next group starts a new segment
            raise
        loc = {"seg": self._wname, "off": self._wpos, "len": end - self._wpos, "batch": self._wbatches, "row": 0}
        self._wpos, self._wbatches = end, self._wbatches + 1
        return loc, loc["len"]

    def _open_segment(self) -> None:
        self._wname = writer_id()
        path = self._seg_dir / (self._wname + IN_PROGRESS)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))  # never someone else's file
        self._sink = pa.OSFile(str(path), "ab")
        self._stream = pa.ipc.new_stream(self._sink, self._pschema)
        self._wpos, self._wbatches = self._sink.tell(), 0

    def seal(self, failed: bool = False) -> None:
        """End this process's segment with the end-of-stream marker and rename it to its sealed name. After a
        failed write, what follows the last whole batch is cut off first (it was never committed)."""
        stream, sink, name = self._stream, self._sink, self._wname
        if stream is None or sink is None or name is None:  # (the three are set together)
            return
        self._stream, self._sink = None, None
        path = self._seg_dir / (name + IN_PROGRESS)
        try:
            if failed:
                sink.close()
                os.truncate(path, self._wpos)
                with open(path, "ab") as f:
                    f.write(EOS)
            else:
                stream.close()
                sink.close()
        except OSError:  # e.g. still no space for the marker: a stream reader stops at the cut anyway
            pass
        if self._wbatches:
            os.rename(path, self._seg_dir / (name + SEALED))
        else:
            path.unlink(missing_ok=True)

    def after_fork(self) -> None:
        self._stream = self._sink = None  # the parent's segment stays the parent's (dropping them writes nothing)
        self._segments = {}
        self._views, self._wholes = {}, {}

    def writer_name(self) -> str:
        return self._wname or super().writer_name()

    def after_commit(self) -> None:
        """In a store that evicts (this handle's retention, or another's: some group was evicted), seal this
        process's segment once it holds ``roll_bytes`` (an eighth of the live bytes, at least 256 KiB): its
        groups' bytes are freed with the file once they are all evicted."""
        if self._stream is None or self._wpos < roll_bytes(self.ledger.live_bytes):
            return
        if self.evicts or self.ledger.evicted_upto >= 0:
            self.seal()
            self._swept = False  # its groups may all be evicted already: the next eviction deletes the file

    # -- reading ------------------------------------------------------------------------------------------
    def block_id(self, loc: dict, n: int) -> int:
        key = (loc["seg"], loc["off"], loc["len"])
        bid = self._blocks.get(key)
        if bid is None:
            bid = self._blocks[key] = len(self._block_locs)
            self._block_locs.append(key)
        return bid

    def _segment(self, name: str, end: int) -> _Segment:
        seg = self._segments.get(name)
        if seg is None:
            sealed = self._seg_dir / (name + SEALED)
            seg = _Segment(sealed if sealed.exists() else self._seg_dir / (name + IN_PROGRESS))
            self._segments[name] = seg
        try:
            return seg.buffer(end)
        except FileNotFoundError:  # sealed (renamed) since we looked
            seg.path = self._seg_dir / (name + SEALED)
            seg.mm = None
            return seg.buffer(end)

    def _view(self, block: int) -> dict:
        """numpy views (writable, copy-on-write) of one batch's columns."""
        v = self._pins.get(block)
        if v is None:
            v = self._views.get(block)
        if v is not None:
            return v
        name, off, length = self._block_locs[block]
        seg = self._segment(name, off + length)
        try:
            if off + length > seg.size:
                raise ValueError(f"the file ends at byte {seg.size}")
            batch = pa.ipc.read_record_batch(pa.ipc.read_message(seg.pabuf.slice(off, length)), self._pschema)
        except (ValueError, pa.ArrowException) as err:  # committed bytes that no longer read whole
            raise StoreError(f"segment {str(seg.path)!r} is damaged: the committed group at bytes {off}.."
                             f"{off + length} cannot be read ({str(err).splitlines()[0]}); restore the file from "
                             "a backup (rbpipe never rewrites a committed batch)") from None
        v = {}
        i = 0
        n = batch.num_rows

        def arr(buf, dtype, count, first=0):
            dtype = np.dtype(dtype)
            if count == 0 or buf is None:
                return np.zeros(0, dtype)
            start = buf.address - seg.base + first * dtype.itemsize
            if not 0 <= start <= seg.size - count * dtype.itemsize:  # not inside the map: copy
                return np.frombuffer(buf, dtype, count, first * dtype.itemsize).copy()
            return np.frombuffer(seg.mm, dtype, count, start)

        for c in self.schema.columns:
            col = batch.column(i)
            if c.ragged:
                offsets = arr(col.buffers()[1], np.int64, n + 1, col.offset)
                values = arr(col.buffers()[2 if c.text else 3], c.np_dtype, int(offsets[-1]))
                shapes = arr(batch.column(i + 1).buffers()[2], np.int64, n * c.ndim).reshape(n, c.ndim)
                v[c.key] = (values, offsets, shapes)
                i += 2
            else:
                trail = tuple(c.shape) + ((2,) if c.complex else ())
                width = int(np.prod(trail))
                data_buf = col.buffers()[1] if not trail else col.buffers()[2]
                v[c.key] = arr(data_buf, c.np_dtype, n * width).reshape(n, *trail)
                i += 1
        v["__rows__"] = n
        self._views[block] = v
        return v

    def gather(self, block, local_rows, keys=None) -> dict:
        """Columns of ``local_rows`` of one batch; ragged columns as (flat values, shapes) (columns.py)."""
        if block is None:
            return empty_columns(self.schema.columns)
        rows = np.asarray(local_rows)
        if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and (len(rows) == 1 or (np.diff(rows) == 1).all()):
            return self.slice(block, int(rows[0]), int(rows[-1]) + 1, keys)
        return take_columns(self.schema.columns_of(keys), self._view(block), rows)

    def slice(self, block: int, first: int, stop: int, keys=None) -> dict:
        whole = first == 0 and keys is None
        if whole and block in self._wholes and stop == self._wholes[block][0]:
            return self._wholes[block][1]  # a whole batch (one group): sliced once, then reused
        v = self._view(block)
        out = slice_columns(self.schema.columns_of(keys), v, first, stop)
        if whole and stop == v["__rows__"]:
            self._wholes[block] = (stop, out)
        return out

    def whole_table(self, block: int, first: int, stop: int) -> dict | None:
        v = self._view(block)
        return v if first == 0 and stop == v["__rows__"] else None

    def on_commit(self, rec: dict) -> None:
        loc = rec["loc"]
        self._seg_end[loc["seg"]] = max(self._seg_end.get(loc["seg"], 0), loc["off"] + loc["len"])

    def on_live(self, loc: dict, delta: int) -> None:
        name = loc["seg"]
        left = self._seg_live[name] = self._seg_live.get(name, 0) + delta
        if left <= 0:  # let go of its map (a deleted file's disk space is freed once nobody maps it)
            del self._seg_live[name]
            self._swept = False
            if self._segments.pop(name, None) is not None:
                self._views = {b: v for b, v in self._views.items() if self._block_locs[b][0] != name}
                self._wholes = {b: v for b, v in self._wholes.items() if b in self._views}

    def hold_block(self, block: int) -> dict:
        return self._view(block)  # its arrays reference the segment's map: readable after the file is deleted

    def on_move(self, rec: dict) -> None:
        self._views = {b: v for b, v in self._views.items() if self._block_locs[b][0] != rec.get("from")}
        self._wholes = {b: v for b, v in self._wholes.items() if b in self._views}

    # -- maintenance --------------------------------------------------------------------------------------
    def check_tail(self, report: dict) -> dict:
        """Report data that is on disk but not committed (never served): dead writers' uncommitted tails."""
        out = dict(report)
        committed_end = self._seg_end  # evicted groups' batches were committed too
        torn = []
        for p in self._seg_dir.glob("*" + IN_PROGRESS):
            name = p.name[: -len(IN_PROGRESS)]
            try:
                host, pid = name.rsplit("-", 2)[0], int(name.rsplit("-", 2)[1])
            except (ValueError, IndexError):
                continue
            import socket
            if host != socket.gethostname() or pid_alive(pid):
                continue
            size = p.stat().st_size
            end = committed_end.get(name, 0)
            if size > end:
                torn.append({"segment": p.name, "uncommitted_bytes": size - end})
        out["dead_segments_with_uncommitted_bytes"] = torn
        return out

    def maintenance_lock(self, blocking: bool = True):
        """``with backend.maintenance_lock() as held:`` the flock of ``.compact.lock``: compaction holds it
        while it reads groups and while it publishes its output, and evictors delete segment files only while
        holding it, so neither deletes what the other is about to reference."""
        return file_lock(self.path / ".compact.lock", blocking=blocking)

    def compactable(self) -> list[dict]:
        """The live groups in sealed segments, unless they already are one batch."""
        sealed = {p.name[: -len(SEALED)] for p in self._seg_dir.glob("*" + SEALED)}
        recs = [r for r in self.ledger.groups.values() if r["loc"]["seg"] in sealed]
        return recs if len({(r["loc"]["seg"], r["loc"]["off"]) for r in recs}) > 1 else []

    def write_compacted(self, parts: list[dict], rows: int) -> tuple[str, dict]:
        """Write the gathered groups ``parts`` as one batch of a new segment, fsynced, under its temporary
        name ``compact-<host>-<pid>-<rand>.tmp`` (evictors leave a live compactor's ``.tmp`` alone; a dead
        one's is swept like a dead writer's file): (its name, the loc of the batch). :meth:`publish_compacted`
        gives it its sealed name."""
        merged = GroupColumns(n=rows)
        for c in self.schema.columns:
            if c.ragged:
                merged.ragged[c.key] = (np.concatenate([p[c.key][0] for p in parts]),
                                        np.concatenate([p[c.key][1] for p in parts]))
            else:
                merged.fixed[c.key] = np.concatenate([p[c.key] for p in parts])
        name = "compact-" + writer_id()
        head = self._pschema.serialize()
        body = to_record_batch(merged, self.schema, self._pschema).serialize()

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(body)
                f.write(EOS)

        write_file(self._seg_dir / (name + ".tmp"), write)
        return name, {"seg": name, "off": head.size, "len": body.size, "batch": 0}

    def publish_compacted(self, name: str) -> None:
        """Rename the output ``name`` to its sealed name (the caller holds the maintenance lock and writes the
        ``move`` record next)."""
        os.replace(self._seg_dir / (name + ".tmp"), self._seg_dir / (name + SEALED))

    def discard_compacted(self, name: str) -> None:
        (self._seg_dir / (name + ".tmp")).unlink(missing_ok=True)

    def after_compaction(self, recs: list[dict], written: str) -> None:
        """Delete the segments the compacted groups came from (those no live group still needs), and the
        files that evictions emptied while the compaction held the lock."""
        for seg in {r["loc"]["seg"] for r in recs} - {written} - set(self._seg_live):
            (self._seg_dir / (seg + SEALED)).unlink(missing_ok=True)
            self._segments.pop(seg, None)
        self._views, self._wholes = {}, {}
        self._sweep_dead_segments()

    def disk_bound(self, writers: int) -> int:
        """``2 L + (W + 1) (R + G)`` plus two file-system blocks per file (retention.py)."""
        live = self.ledger.live_bytes
        largest = max((r["bytes"] for r in self.ledger.groups.values()), default=0)
        files = len(list(self._seg_dir.iterdir()))
        return 2 * live + (writers + 1) * (roll_bytes(live) + largest) + files * 2 * BLOCK

    def after_evict(self) -> None:
        """Delete segment files that hold no live group: sealed ones (this process's open one aside), dead
        writers' in-progress ones and dead compactions' leftovers. Runs when a segment lost its last live
        group (and every 64th eviction, for files no record names); skipped while a compaction holds the
        lock (the next eviction deletes them)."""
        self._evictions += 1
        if self._swept and self._evictions % 64:
            return
        with self.maintenance_lock(blocking=False) as held:
            if held:  # else the compaction holding it sweeps before it lets go
                self._sweep_dead_segments()

    def _sweep_dead_segments(self) -> None:
        """Delete the segment files no live group names and nobody writes any more (caller holds
        ``.compact.lock``). Lists, and tells dead writers' files, *before* reading the log: a file sealed before
        the listing, or a writer dead before the check, has all its commits in the log by the refresh."""
        done = [(fname, name) for fname, name in map(self._finished, os.listdir(self._seg_dir)) if name]
        self.ledger.refresh()
        self._swept = True
        for fname, name in done:
            if name not in self._seg_live and name != self._wname:
                (self._seg_dir / fname).unlink(missing_ok=True)

    @staticmethod
    def _finished(fname: str) -> tuple[str, str | None]:
        """``(fname, segment name)`` when nobody will write to the segment file ``fname`` any more: sealed,
        or in progress (or a compaction's ``.tmp``) of a writer that is dead; else ``(fname, None)``."""
        for suffix, sealed in ((SEALED, True), (IN_PROGRESS, False), (".tmp", False)):
            if fname.endswith(suffix):
                name = fname[: -len(suffix)]
                return fname, name if sealed or not owner_alive(name.removeprefix("compact-")) else None
        return fname, None
