"""``ArrowStorage``: the default store. Arrow IPC stream segments, one record batch per group.

Each writer process appends to its own segment file (``segments/<host>-<pid>-<rand>.arrows.inprogress``,
renamed to ``.arrows`` when sealed), so concurrent writers never share a file. Batches are read back
memory-mapped copy-on-write: zero-copy, and an in-place edit of a sampled tensor never reaches the file.
``compact()`` rewrites the sealed segments' live groups into one batch, after which random-row
sampling is a single numpy gather per column.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from rbpipe.errors import StoreError
from rbpipe.storage.base import UNBOUNDED, GroupStorage, pid_alive, writer_id
from rbpipe.storage.format import SEGMENTS_DIR
from rbpipe.storage.layout import Column, GroupColumns, Schema, empty_columns, slice_columns, take_columns
from rbpipe.storage.retention import owner_alive, roll_bytes

SEALED = ".arrows"
IN_PROGRESS = ".arrows.inprogress"
EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def _pa_type(c: Column) -> pa.DataType:
    return pa.from_numpy_dtype(c.np_dtype)


def arrow_schema(schema: Schema) -> pa.Schema:
    """The Arrow schema of a store's segments (FORMAT.md, "Arrow segments")."""
    fields = []
    for c in schema.columns:
        t = _pa_type(c)
        if c.ragged:
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


def to_record_batch(cols: GroupColumns, schema: Schema, pschema: pa.Schema) -> pa.RecordBatch:
    """A group's columns as one record batch, built from their buffers without copies or per-array
    validation (the types come from ``pschema``; ``pa.array`` + ``from_arrays`` cost a third of a write)."""
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
        self.mm = None
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


class ArrowStorage(GroupStorage):
    """A torchrl ``Storage`` of whole groups on disk (Arrow IPC, memory-mapped). See ``docs/FORMAT.md``.

    Args:
        path: store directory (created if absent and ``create``).

    Keyword Args:
        max_size: live rows kept (oldest whole groups are evicted beyond it); None = unbounded.
        max_bytes: same, in bytes of group data. With either, evicted groups' files are deleted too: the
            segment files hold at most ``2 L + (W + 1) (R + G)`` bytes (``L`` live bytes, ``G`` the largest
            group, ``W`` writer processes, ``R = max(256 KiB, L / 8)`` the size at which a writer starts a
            new segment; docs/FORMAT.md, "Retention and disk").
        ragged_keys: keys whose per-row shape varies (also detected from the first write).
        ragged_layout: how reads return ragged keys: ``"nested"`` (jagged ``torch.nested`` tensors: one values
            tensor plus offsets per field, no padding; the default when every ragged field is 1-D and real),
            ``"rows"`` (a LazyStackedTensorDict of rows, torchrl's LLM convention; the default otherwise; use
            it to index the sampled batch, which nested tensors do not allow along rows) or ``"padded"``
            (dense, zero-padded to the batch's longest row, lengths under ``("lengths", *key)``).
        group_key: key holding the group id (recorded in the catalogue).
        catalog_columns: catalogue column -> (key, "value" | "length"); default: returns, advantages,
            collectors, policy_versions, lengths (columns whose key is absent are skipped).
        create: create the store when ``path`` is not one yet.
    """

    backend = "arrow"

    def _open_backend(self) -> None:
        self._seg_dir = self.path / SEGMENTS_DIR
        self._seg_dir.mkdir(exist_ok=True)
        self._segments: dict[str, _Segment] = {}
        self._blocks: dict[tuple, int] = {}
        self._block_locs: list[tuple] = []
        self._views: dict[int, dict] = {}
        self._wholes: dict[int, tuple[int, dict]] = {}  # block -> (rows, its columns as _slice returns them)
        self._pschema = None
        self._stream: pa.ipc.RecordBatchStreamWriter | None = None  # this process's open segment
        self._sink: pa.OSFile | None = None
        self._wname = None
        self._wpos = 0
        self._wbatches = 0
        self._seg_live: dict[str, int] = {}  # segment -> live groups in it
        self._seg_end: dict[str, int] = {}  # segment -> end of its last committed batch (evicted ones too)
        self._swept = True  # no segment lost its last live group since the last sweep
        self._evictions = 0

    def _on_schema(self, schema: Schema) -> None:
        self._pschema = arrow_schema(schema)

    # -- writing ------------------------------------------------------------------------------------------
    def _write_group(self, cols: GroupColumns) -> tuple[dict, int]:
        batch = to_record_batch(cols, self._schema, self._pschema)
        if self._stream is None:
            self._open_segment()
        try:  # the IPC writer copies the columns straight into the file: no serialised copy in between
            self._stream.write_batch(batch)
            end = self._sink.tell()
            if self._wbatches == 0:  # the writer puts the schema message before its first batch
                self._wpos += self._pschema.serialize().size
        except OSError:
            self._seal(failed=True)  # cut the partial batch off; the next group starts a new segment
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

    def _seal(self, failed: bool = False) -> None:
        """End this process's segment with the end-of-stream marker and rename it to its sealed name. After a
        failed write, what follows the last whole batch is cut off first (it was never committed)."""
        if self._stream is None:
            return
        stream, sink, self._stream, self._sink = self._stream, self._sink, None, None
        path = self._seg_dir / (self._wname + IN_PROGRESS)
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
            os.rename(path, self._seg_dir / (self._wname + SEALED))
        else:
            path.unlink(missing_ok=True)

    def _after_fork(self) -> None:
        super()._after_fork()
        self._stream = self._sink = None  # the parent's segment stays the parent's (dropping them writes nothing)
        self._segments = {}
        self._views, self._wholes = {}, {}

    def _writer_name(self) -> str:
        return self._wname or super()._writer_name()

    def _after_commit(self) -> None:
        """In a store that evicts (this handle's retention, or another's: some group was evicted), seal this
        process's segment once it holds ``roll_bytes`` (an eighth of the live bytes, at least 256 KiB): its
        groups' bytes are freed with the file once they are all evicted."""
        if self._stream is None or self._wpos < roll_bytes(self._live_bytes):
            return
        if self.max_size != UNBOUNDED or self.max_bytes is not None or self._evicted_upto >= 0:
            self._seal()
            self._swept = False  # its groups may all be evicted already: the next eviction deletes the file

    # -- reading ------------------------------------------------------------------------------------------
    def _block_id(self, loc: dict, n: int) -> int:
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

        for c in self._schema.columns:
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

    def _gather(self, block, local_rows, keys=None) -> dict:
        """Columns of ``local_rows`` of one batch; ragged columns as (flat values, shapes) (layout.py)."""
        if block is None:
            return empty_columns(self._schema.columns)
        rows = np.asarray(local_rows)
        if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and (len(rows) == 1 or (np.diff(rows) == 1).all()):
            return self._slice(block, int(rows[0]), int(rows[-1]) + 1, keys)
        return take_columns(self._schema.columns_of(keys), self._view(block), rows)

    def _slice(self, block: int, first: int, stop: int, keys=None) -> dict:
        whole = first == 0 and keys is None
        if whole and block in self._wholes and stop == self._wholes[block][0]:
            return self._wholes[block][1]  # a whole batch (one group): sliced once, then reused
        v = self._view(block)
        out = slice_columns(self._schema.columns_of(keys), v, first, stop)
        if whole and stop == v["__rows__"]:
            self._wholes[block] = (stop, out)
        return out

    def _whole_table(self, block: int, first: int, stop: int) -> dict | None:
        v = self._view(block)
        return v if first == 0 and stop == v["__rows__"] else None

    def _on_commit(self, rec: dict) -> None:
        loc = rec["loc"]
        self._seg_end[loc["seg"]] = max(self._seg_end.get(loc["seg"], 0), loc["off"] + loc["len"])

    def _on_live(self, loc: dict, delta: int) -> None:
        name = loc["seg"]
        left = self._seg_live[name] = self._seg_live.get(name, 0) + delta
        if left <= 0:  # let go of its map (a deleted file's disk space is freed once nobody maps it)
            del self._seg_live[name]
            self._swept = False
            if self._segments.pop(name, None) is not None:
                self._views = {b: v for b, v in self._views.items() if self._block_locs[b][0] != name}
                self._wholes = {b: v for b, v in self._wholes.items() if b in self._views}

    def _hold_block(self, block: int) -> None:
        self._view(block)

    def _on_move(self, rec: dict) -> None:
        self._views = {b: v for b, v in self._views.items() if self._block_locs[b][0] != rec.get("from")}
        self._wholes = {b: v for b, v in self._wholes.items() if b in self._views}

    # -- maintenance --------------------------------------------------------------------------------------
    def check_tail(self) -> dict:
        """Report data that is on disk but not committed (never served): dead writers' uncommitted tails."""
        out = super().check_tail()
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

    def _maintenance_lock(self) -> int:
        """An open descriptor of ``.compact.lock``: compaction holds it throughout, and evictors delete
        segment files only while holding it, so neither deletes what the other is about to reference."""
        return os.open(self.path / ".compact.lock", os.O_RDWR | os.O_CREAT, 0o644)

    def compact(self) -> int:
        """Rewrite the live groups of sealed segments into one sealed segment of one batch.

        Returns the number of groups moved. Random-row reads then touch one batch. Concurrent compactions
        run one after the other (the second finds little to do); writers are not blocked; old segments are
        deleted after the ``move`` record. Evictors delete no segment file while this runs (the lock): the
        new file is unreferenced until the record is written, and the old ones are being read.
        """
        lock_fd = self._maintenance_lock()
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            self._refresh()
            if self._schema is None:
                return 0
            sealed = {p.name[: -len(SEALED)] for p in self._seg_dir.glob("*" + SEALED)}
            recs = [r for r in self._groups.values() if r["loc"]["seg"] in sealed]
            if not recs or len({(r["loc"]["seg"], r["loc"]["off"]) for r in recs}) == 1:
                return 0
            name, loc0, moves = self._write_compacted(recs)
            self._log.append(lambda seq: {"t": "move", "time": time.time(),
                                          "groups": [[s, dict(loc0, row=row)] for s, row in moves]},
                             self._apply)
            for seg in {r["loc"]["seg"] for r in recs} - {name} - set(self._seg_live):
                (self._seg_dir / (seg + SEALED)).unlink(missing_ok=True)
                self._segments.pop(seg, None)
            self._views, self._wholes = {}, {}
            self._sweep_dead_segments()  # files that evictions emptied while this held the lock
            return len(moves)
        finally:
            os.close(lock_fd)

    def _write_compacted(self, recs: list[dict]) -> tuple[str, dict, list[list[int]]]:
        """Write the groups ``recs`` as one batch of a new sealed segment (tmp file, fsync, rename):
        (its name, the loc of the batch, [seq, first row in the batch] per group)."""
        from rbpipe.storage.layout import GroupColumns as GC
        merged = GC(n=0)
        parts = []
        rowpos = 0
        moves = []
        for r in recs:
            b = self._block_id(r["loc"], r["n"])
            rows = np.arange(r["loc"]["row"], r["loc"]["row"] + r["n"])
            parts.append(self._gather(b, rows))
            moves.append([r["seq"], rowpos])
            rowpos += r["n"]
        merged.n = rowpos
        for c in self._schema.columns:
            if c.ragged:
                merged.ragged[c.key] = (np.concatenate([p[c.key][0] for p in parts]),
                                        np.concatenate([p[c.key][1] for p in parts]))
            else:
                merged.fixed[c.key] = np.concatenate([p[c.key] for p in parts])
        name = "compact-" + _wid()
        head = self._pschema.serialize()
        body = to_record_batch(merged, self._schema, self._pschema).serialize()
        tmp = self._seg_dir / (name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(body)
            f.write(EOS)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, self._seg_dir / (name + SEALED))
        return name, {"seg": name, "off": head.size, "len": body.size, "batch": 0}, moves

    def _after_evict(self) -> None:
        """Delete segment files that hold no live group: sealed ones (this process's open one aside), dead
        writers' in-progress ones and dead compactions' leftovers. Runs when a segment lost its last live
        group (and every 64th eviction, for files no record names); skipped while a compaction holds the
        lock (the next eviction deletes them)."""
        self._evictions += 1
        if self._swept and self._evictions % 64:
            return
        lock_fd = self._maintenance_lock()
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # the compaction holding it sweeps before it lets go
            self._sweep_dead_segments()
        finally:
            os.close(lock_fd)

    def _sweep_dead_segments(self) -> None:
        """Delete the segment files no live group names and nobody writes any more (caller holds
        ``.compact.lock``). Lists, and tells dead writers' files, *before* reading the log: a file sealed before
        the listing, or a writer dead before the check, has all its commits in the log by the refresh."""
        done = [(fname, name) for fname, name in map(self._finished, os.listdir(self._seg_dir)) if name]
        self._refresh()
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


def _wid() -> str:
    return writer_id()
