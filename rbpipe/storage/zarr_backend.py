"""``ZarrBackend``: the same group store's bytes in Zarr v3 arrays (archive / export target, optional backend).

Zarr has no locking and rewrites a whole chunk on a partial write, so each writer process reserves whole
chunks (rows, and values of ragged fields) under an ``fcntl`` lock and fills them with its own groups only:
no two processes ever share a chunk, and no group straddles a chunk boundary unless it is larger than a
chunk. Arrays are created once with a huge fixed shape (never ``append``/``resize``), and a group becomes
visible only through its commit-log line, written last.

Size (over 500 lines): one backend end to end, the twin of ``arrow_backend.py``: chunk reservation, ragged values,
writes and reads share the invariant above (no two processes in one chunk), which a split would spread over two
files.
"""

from __future__ import annotations

import errno
import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from rbpipe.errors import StoreError
from rbpipe.storage.backend import Backend, writer_id
from rbpipe.storage.columns import GroupColumns, empty_columns, ragged_sizes, row_elements, slice_columns, take_columns
from rbpipe.storage.format import ZARR_DIR
from rbpipe.storage.retention import ChunkLedger
from rbpipe.system.fsutil import atomic_write, file_lock

MAX_CHUNKS = 2 ** 18  # chunks per array (zarr indexing cost grows with the chunk count)
VALUE_CHUNK = 2 ** 18  # values per chunk of a ragged field's values array
RESERVE_GROUPS = 32  # groups' worth of rows/values a writer process reserves per allocator visit
MAX_CHUNK_BYTES = 8 * 2 ** 20  # row chunks hold RESERVE_GROUPS first-size groups, fewer if rows are wide
OPEN_CHUNKS = 64  # chunk files a process keeps open (creating or opening a file is costly)
ALLOC_FILE = "zarr_alloc.json"


def _raw_chunk_rows(arr) -> int:
    """Rows per chunk when ``arr`` keeps each chunk as its raw little-endian bytes in a local directory
    (one codec, ``bytes``; default ``/`` chunk keys; chunked along the first axis only); else 0."""
    meta = arr.metadata.to_dict()
    codecs = meta.get("codecs") or []
    raw = (len(codecs) == 1 and codecs[0].get("name") == "bytes"
           and (codecs[0].get("configuration") or {}).get("endian", "little") == "little")
    keys = meta.get("chunk_key_encoding") or {}
    default_keys = keys.get("name") == "default" and (keys.get("configuration") or {}).get("separator") == "/"
    local = type(arr.store).__name__ == "LocalStore"
    whole_rows = tuple(arr.chunks[1:]) == tuple(arr.shape[1:])
    return int(arr.chunks[0]) if raw and default_keys and local and whole_rows else 0


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


def _fit(cursor: int, size: int, chunk: int) -> int:
    """First position >= ``cursor`` where ``size`` elements stay inside one chunk (or, for more than a
    chunk's worth, the next chunk boundary): a group is never split across chunks it need not span."""
    if size > chunk or cursor % chunk + size > chunk:
        return _round_up(cursor, chunk)
    return cursor


class _RawChunks:
    """Chunk files of one array written and read in place with ``pwrite``/``preadv``.

    Valid for arrays whose chunks are raw little-endian bytes (``_raw_chunk_rows``): a chunk file is
    created at its full size (a sparse file of zeros, the fill value) and each group's bytes are written at
    their offset, so a chunk holds many groups without zarr-python's read-modify-write of whole chunks."""

    def __init__(self, base: Path, chunk: int, tail: tuple, dtype: np.dtype) -> None:
        self.base, self.chunk, self.tail = base, chunk, tail
        self.dtype = dtype.newbyteorder("<")
        self.row_bytes = self.dtype.itemsize * int(np.prod(tail))
        self.suffix = "/0" * len(tail)  # the chunk index along every unchunked axis
        self.fds: OrderedDict[tuple[int, bool], int] = OrderedDict()

    def _fd(self, k: int, write: bool) -> int:
        fd = self.fds.get((k, write))
        if fd is not None:
            self.fds.move_to_end((k, write))
            return fd
        path = f"{self.base}/{k}{self.suffix}"
        if write:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            if os.fstat(fd).st_size < self.chunk * self.row_bytes:
                os.ftruncate(fd, self.chunk * self.row_bytes)
        else:
            fd = os.open(path, os.O_RDONLY)  # a committed row's chunk exists unless retention deleted it:
            # FileNotFoundError then (the reader's view is older than the eviction), never zeros
        self.fds[(k, write)] = fd
        while len(self.fds) > OPEN_CHUNKS:
            os.close(self.fds.popitem(last=False)[1])
        return fd

    def _pieces(self, start: int, n: int):
        """(chunk index, byte offset in it, first row in the data, rows) of the rows ``start..start+n``."""
        pos = 0
        while pos < n:
            k, within = divmod(start + pos, self.chunk)
            take = min(n - pos, self.chunk - within)
            yield k, within * self.row_bytes, pos, take
            pos += take

    def write(self, start: int, data: np.ndarray) -> None:
        buf = np.ascontiguousarray(data, self.dtype).data.cast("B")  # (.data: the array's memoryview)
        rb = self.row_bytes
        for k, offset, first, rows in self._pieces(start, len(data)):
            piece = buf[first * rb:(first + rows) * rb]
            if os.pwrite(self._fd(k, True), piece, offset) != len(piece):
                raise OSError(errno.ENOSPC, f"short write to chunk {k} of {self.base.parent.name}")

    def read(self, start: int, n: int) -> np.ndarray:
        """Rows ``start..start+n`` (committed rows: they must be there whole). A chunk file that ends before
        them was cut after the commit: a StoreError naming it, as zarr-python raises, never zeros."""
        out = np.zeros((n, *self.tail), self.dtype)
        flat = out.reshape(-1).data.cast("B")
        rb = self.row_bytes
        for k, offset, first, rows in self._pieces(start, n):
            fd = self._fd(k, False)
            if fd is not None:
                self._read_whole(fd, k, flat[first * rb:(first + rows) * rb], offset)
        return out

    def _read_whole(self, fd: int, k: int, buf: memoryview, offset: int) -> None:
        got = 0
        while got < len(buf):
            m = os.preadv(fd, [buf[got:]], offset + got)
            if m <= 0:
                path = f"{self.base}/{k}{self.suffix}"
                raise StoreError(f"Zarr chunk file {path} ends at byte {os.fstat(fd).st_size} but committed rows "
                                 f"need bytes {offset}..{offset + len(buf)} (a whole chunk is "
                                 f"{self.chunk * self.row_bytes} bytes): it was cut short after the commit; restore "
                                 "it from a backup (these rows cannot be read)")
            got += m

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.popitem()[1])

    def drop(self, k: int) -> None:
        """Close chunk ``k`` (its groups are evicted: an open descriptor would keep a deleted file's space)."""
        for key in ((k, False), (k, True)):
            fd = self.fds.pop(key, None)
            if fd is not None:
                os.close(fd)

    def unlink(self, k: int) -> None:
        """Delete chunk ``k``'s file (and the directory only it used)."""
        self.drop(k)
        Path(f"{self.base}/{k}{self.suffix}").unlink(missing_ok=True)
        for depth in range(len(self.tail) - 1, -1, -1):  # its directories (``k/0/...``), deepest first
            try:
                os.rmdir(f"{self.base}/{k}" + "/0" * depth)
            except OSError:
                pass

    @property
    def chunk_bytes(self) -> int:
        return self.chunk * self.row_bytes


class ZarrBackend(Backend):
    """Group bytes in a Zarr v3 group (``STORE/data.zarr``), each writer filling chunks it reserved.

    With retention, chunk files whose groups are all evicted are deleted once their writer has moved past
    them: the chunk files are those holding a live group plus at most two per writer and array
    (docs/FORMAT.md, "Retention and disk")."""

    name = "zarr"
    schema_copy = "the 'schema' attribute of data.zarr/zarr.json"
    whole_tables = True
    cache_bytes = 256 * 2 ** 20  # decoded groups kept for sampling (per process)

    def __init__(self, path: Path, ledger, *, evicts: bool) -> None:
        super().__init__(path, ledger, evicts=evicts)
        self._zpath = self.path / ZARR_DIR
        self._arrays: dict[str, Any] | None = None  # zarr arrays opened so far, by name
        self._group_rows: dict[int, int] = {}  # first row -> rows of each committed group
        self._cache: OrderedDict[int, dict] = OrderedDict()
        self._cache_bytes: dict[int, int] = {}
        self._cached_total = 0
        self._raw: dict[str, _RawChunks | None] = {}  # array -> in-place chunk access, None if not raw bytes
        self._chunk_rows: int | None = None
        self._reserved: dict | None = None
        self._reserved_pid = os.getpid()
        self._wname: str | None = None  # this instance's writer name (reservations are per instance)
        self._chunk_ledgers: dict[str, ChunkLedger] = {}  # "" (row arrays) or a ragged column -> its chunks' groups
        self._pending: list[dict] = []  # groups seen before the arrays' chunk sizes could be read
        self._family_arrays: dict[str, list[str]] | None = None

    def _zarr(self):
        if self._arrays is None:
            import zarr
            self._group = zarr.open_group(str(self._zpath), mode="a")
            self._arrays = {}
        return self._group

    def _arr(self, name: str):
        a = self._arrays.get(name) if self._arrays is not None else None
        if a is None:
            a = self._zarr()[name]
            assert self._arrays is not None  # (_zarr() opened the group)
            self._arrays[name] = a
        return a

    def _create_arrays(self, first_rows: int) -> None:
        """Once per store, under the allocation lock: a row chunk holds ``RESERVE_GROUPS`` groups the size
        of the first one (fewer when that would exceed ``MAX_CHUNK_BYTES`` of one column)."""
        g = self._zarr()
        if "__created" in g.attrs:
            return
        widest = max((int(np.prod(c.shape or ())) * c.np_dtype.itemsize * (2 if c.complex else 1)
                      for c in self.schema.columns if not c.ragged), default=8)
        groups = max(1, min(RESERVE_GROUPS, MAX_CHUNK_BYTES // max(1, widest * first_rows)))
        chunk_rows = first_rows * groups
        cap, vcap = chunk_rows * MAX_CHUNKS, VALUE_CHUNK * MAX_CHUNKS
        for c in self.schema.columns:
            trail = (2,) if c.complex else ()
            if c.ragged:
                g.create_array(c.name + ".values", shape=(vcap, *trail), chunks=(VALUE_CHUNK, *trail),
                               dtype=c.np_dtype, fill_value=0, compressors=None)
                g.create_array(c.name + ".start", shape=(cap,), chunks=(chunk_rows,), dtype=np.int64,
                               fill_value=0, compressors=None)
                g.create_array(c.name + ".shape", shape=(cap, c.ndim), chunks=(chunk_rows, c.ndim),
                               dtype=np.int64, fill_value=0, compressors=None)
            else:
                shape = (*c.shape, *trail)
                g.create_array(c.name, shape=(cap, *shape), chunks=(chunk_rows, *shape),
                               dtype=c.np_dtype, fill_value=0, compressors=None)
        g.attrs.update({"__created": True, "chunk_rows": chunk_rows, "value_chunk": VALUE_CHUNK,
                        "schema": self.schema.to_json()})

    def _value_chunk(self, name: str) -> int:
        return int(self._arr(name + ".values").chunks[0])

    def _allocate(self, cols: GroupColumns) -> tuple[int, dict]:
        """Row and value positions for one group inside this process's reserved chunks.

        Under the lock a process reserves whole chunks with room for ``RESERVE_GROUPS`` groups (the sidecar
        swap costs more than the group's own writes); ranges are never handed out twice, and what a process
        leaves unused when it stops stays unused (it reads as zeros; no commit points at it).
        """
        if self._reserved_pid != os.getpid():
            self._reserved, self._reserved_pid = None, os.getpid()
        if self._chunk_rows is None:
            self._create_arrays_locked(cols.n)
        assert self._chunk_rows is not None  # (read by _create_arrays_locked)
        n = cols.n
        sizes = {c.name: len(cols.ragged[c.key][0]) for c in self.schema.columns if c.ragged}
        for _ in range(2):
            r = self._reserved
            if r is not None:
                row = _fit(r["rows"][0], n, self._chunk_rows)
                vals = {name: _fit(r["values"][name][0], size, self._value_chunk(name))
                        for name, size in sizes.items()}
                if row + n <= r["rows"][1] and all(vals[k] + sizes[k] <= r["values"][k][1] for k in sizes):
                    r["rows"][0] = row + n
                    for k in sizes:
                        r["values"][k][0] = vals[k] + sizes[k]
                    return row, vals
            self._reserved = self._reserve(n, sizes)
        raise AssertionError("a fresh reservation always fits the group")

    def _create_arrays_locked(self, first_rows: int) -> None:
        with self._alloc_lock():
            self._arrays = None  # re-read the group's attributes: another process may have created the arrays
            self._create_arrays(first_rows)
        self._chunk_rows = int(self._zarr().attrs["chunk_rows"])

    def _alloc_lock(self):
        return file_lock(self.path / ".alloc.lock")

    def _reserve(self, n: int, sizes: dict[str, int]) -> dict:
        """Take the next whole chunks of rows and values (flock, the sidecar replaced with atomic_write)."""
        assert self._chunk_rows is not None  # (the caller created the arrays)
        with self._alloc_lock():
            cap = self._chunk_rows * MAX_CHUNKS
            path = self.path / ALLOC_FILE
            state = self._alloc_state(path)
            row = _round_up(state["rows"], self._chunk_rows)
            if row + n > cap:
                raise StoreError(f"the Zarr store {str(self.path)!r} is full ({cap} rows of space); export to "
                                 "a new store or use the Arrow backend")
            state["rows"] = min(cap, row + _round_up(RESERVE_GROUPS * n, self._chunk_rows))
            block: dict[str, Any] = {"rows": [row, state["rows"]], "values": {}}
            for name, size in sizes.items():
                chunk = self._value_chunk(name)
                vcap = int(self._arr(name + ".values").shape[0])
                start = _round_up(state["values"].get(name, 0), chunk)
                if start + size > vcap:
                    raise StoreError(f"the Zarr store {str(self.path)!r} has no value space left for {name!r}; "
                                     "export to a new store or use the Arrow backend")
                state["values"][name] = min(vcap, start + _round_up(max(1, RESERVE_GROUPS * size), chunk))
                block["values"][name] = [start, state["values"][name]]
            # no fsync: a lost sidecar is rebuilt from the chunk files on disk (_alloc_state)
            atomic_write(path, json.dumps(state), fsync=False, tmp_name=f".{ALLOC_FILE}.{os.getpid()}")
            return block

    def _alloc_state(self, path: Path) -> dict:
        """The allocator state (read under the allocation lock). A missing file is rebuilt from the chunks
        on disk, so that no committed row or value is handed out twice; an unreadable one is refused."""
        if not path.exists():
            return self._alloc_from_chunks()
        try:
            state = json.loads(path.read_text())
            return {"rows": int(state["rows"]), "values": {str(k): int(v) for k, v in state["values"].items()}}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StoreError(f"the Zarr allocator state {str(path)!r} is unreadable ({type(exc).__name__}: {exc}); "
                             "stop every writer of this store, then delete that file: the next writer rebuilds it "
                             "from the chunk files on disk") from None

    def _alloc_from_chunks(self) -> dict:
        """Allocator state past every chunk file on disk and every live group (a store whose
        ``zarr_alloc.json`` was deleted; a brand-new store gets zeros)."""
        def end(name: str, per_chunk: int) -> int:
            root = self._zpath / name / "c"
            ks = [int(p.name) for p in root.iterdir() if p.name.isdigit()] if root.is_dir() else []
            return (max(ks) + 1) * per_chunk if ks else 0

        assert self._chunk_rows is not None  # (only _reserve gets here)
        rows, values = 0, {}
        for c in self.schema.columns:
            for name in ((c.name + ".start", c.name + ".shape") if c.ragged else (c.name,)):
                rows = max(rows, end(name, self._chunk_rows))
            if c.ragged:
                values[c.name] = end(c.name + ".values", self._value_chunk(c.name))
        for r in self.ledger.groups.values():
            rows = max(rows, r["loc"]["row"] + r["n"])
        return {"rows": rows, "values": values}

    def write_group(self, cols: GroupColumns) -> tuple[dict, int]:
        row, vals = self._allocate(cols)
        nbytes = 0
        for c in self.schema.columns:
            if c.ragged:
                values, shapes = cols.ragged[c.key]
                v0 = vals[c.name]
                sizes = row_elements(shapes)
                starts = v0 + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
                if len(values):
                    self._put(c.name + ".values", v0, values)
                self._put(c.name + ".start", row, starts)
                self._put(c.name + ".shape", row, shapes)
                nbytes += values.nbytes + shapes.nbytes
            else:
                self._put(c.name, row, cols.fixed[c.key])
                nbytes += cols.fixed[c.key].nbytes
        return {"row": row, "vals": vals, "vlen": {c.name: len(cols.ragged[c.key][0]) for c in self.schema.columns
                                                   if c.ragged}}, nbytes

    def _raw_chunks(self, name: str) -> _RawChunks | None:
        if name not in self._raw:
            arr = self._arr(name)
            chunk = _raw_chunk_rows(arr)
            self._raw[name] = (_RawChunks(self._zpath / name / "c", chunk, tuple(arr.shape[1:]), arr.dtype)
                               if chunk else None)
        return self._raw[name]

    def _put(self, name: str, start: int, data: np.ndarray) -> None:
        """Write ``data`` at row ``start`` of array ``name`` (inside chunks reserved by this process).

        Our arrays are uncompressed with zarr's default chunk keys, so a chunk *is* its raw little-endian
        bytes at ``NAME/c/I/0/...`` (Zarr v3 spec, ``bytes`` codec) and the rows are written in place in the
        chunk file: a ``pwrite`` instead of a far costlier zarr-python indexing call (figures: docs/DESIGN.md, Figures
        behind code choices). Any other array layout (made by another tool) goes through zarr."""
        raw = self._raw_chunks(name)
        if raw is None:
            self._arr(name)[start:start + len(data)] = data
        else:
            raw.write(start, data)

    def _get(self, name: str, start: int, n: int) -> np.ndarray:
        """Rows ``start..start+n`` of array ``name`` (``preadv`` from the chunk files when they are raw)."""
        raw = self._raw_chunks(name)
        return self._arr(name)[start:start + n] if raw is None else raw.read(start, n)

    def after_fork(self) -> None:
        self._raw = {}  # file descriptors are per process (the parent's stay the parent's)
        self._wname = None

    def writer_name(self) -> str:
        """``<host>-<pid>-<rand>``: one per instance, as reservations are (an evictor tells from it whether
        the writer of a chunk is alive and has moved past it)."""
        if self._wname is None:
            self._wname = writer_id()
        return self._wname

    # -- retention ----------------------------------------------------------------------------------------
    def _families(self) -> dict[str, list[str]]:
        """Chunk families: arrays chunked alike, whose chunk ``k`` holds the same groups."""
        if self._family_arrays is None:
            rows = [n for c in self.schema.columns
                    for n in ((c.name + ".start", c.name + ".shape") if c.ragged else (c.name,))]
            self._family_arrays = {"": rows, **{c.name: [c.name + ".values"]
                                                for c in self.schema.columns if c.ragged}}
        return self._family_arrays

    def _chunk_ledgers_ready(self) -> bool:
        """Build the chunk ledgers once the arrays exist (their chunk sizes are in the group's attributes)."""
        if self._chunk_ledgers:
            return True
        try:
            chunk_rows = int(self._zarr().attrs["chunk_rows"])
        except Exception:  # noqa: BLE001 - no arrays (or no zarr group) yet
            self._arrays = None
            return False
        self._chunk_ledgers[""] = ChunkLedger(chunk_rows)
        for name in self._families():
            if name:
                self._chunk_ledgers[name] = ChunkLedger(self._value_chunk(name))
        return True

    def on_commit(self, rec: dict) -> None:
        self._pending.append(rec)
        if not self._chunk_ledgers_ready():
            return
        for r in self._pending:
            loc, writer = r["loc"], r.get("writer", "")
            self._chunk_ledgers[""].add(r["seq"], writer, loc["row"], r["n"])
            for name, start in loc.get("vals", {}).items():
                size = loc.get("vlen", {}).get(name, 1)
                if size and name in self._chunk_ledgers:
                    self._chunk_ledgers[name].add(r["seq"], writer, start, size)
        self._pending = []

    def on_live(self, loc: dict, delta: int) -> None:
        if delta > 0 or not self._raw:
            return
        for name, ledger in self._chunk_ledgers.items():  # close what this process holds open of dead chunks
            start = loc["row"] if not name else loc.get("vals", {}).get(name)
            if start is None:
                continue
            k = start // ledger.chunk
            if ledger.newest.get(k, -1) <= self.ledger.evicted_upto:
                for arr in self._families()[name]:
                    raw = self._raw.get(arr)
                    if raw is not None:
                        raw.drop(k)

    def hold_block(self, block: int) -> dict:
        return self._cached_group(block)  # the group's columns, read into memory

    def after_evict(self) -> None:
        """Delete the chunk files whose groups are all evicted and whose writer has moved past them or died
        (docs/FORMAT.md, "Retention and disk"). Writers are checked first, then the log is read again: a
        writer found dead has committed all it ever will, so a chunk still dead after that stays dead."""
        if not self._chunk_ledgers_ready():
            return
        candidates = {name: ledger.candidates(self.ledger.evicted_upto) for name, ledger in self._chunk_ledgers.items()}
        if not any(candidates.values()):
            return
        self.ledger.refresh()
        families = self._families()
        for name, ks in candidates.items():
            for k in self._chunk_ledgers[name].confirm(ks, self.ledger.evicted_upto):
                for arr in families[name]:
                    raw = self._raw_chunks(arr)
                    if raw is not None:
                        raw.unlink(k)

    def disk_bound(self, writers: int) -> int:
        """The most the chunk files may hold now (docs/FORMAT.md, "Retention and disk"): the chunks holding
        a live group plus two per writer, per array, at most a whole chunk each, and the metadata files."""
        if not self._chunk_ledgers_ready():
            return 0
        total, arrays = 0, 0
        for name, ledger in self._chunk_ledgers.items():
            live = sum(1 for seq in ledger.newest.values() if seq > self.ledger.evicted_upto)
            for arr in self._families()[name]:
                raw = self._raw_chunks(arr)
                arrays += 1
                total += (live + 2 * writers) * (raw.chunk_bytes if raw is not None else 0)
        return total + (arrays + 1) * 2 * 4096

    def seal(self) -> None:
        for raw in self._raw.values():
            if raw is not None:
                raw.close()
        self._raw = {}

    def block_id(self, loc: dict, n: int) -> int:
        """Each group is its own block: its first row (``_gather`` then reads and caches whole groups)."""
        self._group_rows[loc["row"]] = n
        return loc["row"]

    def gather(self, block, local_rows, keys=None) -> dict:
        """Rows of one group. The group's columns are read whole (they are whole chunks) and kept in a
        bounded LRU cache of decoded groups: zarr-python pays a fixed cost per indexing call and keeps no
        cache (figures: docs/DESIGN.md, Figures behind code choices), and committed groups never change, so a warm
        sample costs numpy slicing only."""
        if block is None:
            return empty_columns(self.schema.columns)
        rows = np.asarray(local_rows, np.int64) - block
        return take_columns(self.schema.columns_of(keys), self._cached_group(block), rows)

    def slice(self, block: int, first: int, stop: int, keys=None) -> dict:
        return slice_columns(self.schema.columns_of(keys), self._cached_group(block), first - block, stop - block)

    def whole_table(self, block: int, first: int, stop: int) -> dict | None:
        return self._cached_group(block) if first == block and stop - block == self._group_rows[block] else None

    def _cached_group(self, block: int) -> dict:
        group = self._pins.get(block)
        if group is not None:
            return group
        group = self._cache.get(block)
        if group is None:
            return self._read_group(block, self._group_rows[block])
        self._cache.move_to_end(block)
        return group

    def _read_group(self, row: int, n: int) -> dict:
        group: dict[tuple, Any] = {}
        nbytes = 0
        for c in self.schema.columns:
            if c.ragged:
                starts = self._get(c.name + ".start", row, n)
                shapes = self._get(c.name + ".shape", row, n)
                total = int(ragged_sizes(shapes, c).sum()) // (2 if c.complex else 1)
                values = (self._get(c.name + ".values", int(starts[0]), total) if total
                          else np.zeros((0, *((2,) if c.complex else ())), c.np_dtype))
                values = values.reshape(-1)  # flat scalars, as Arrow's views (complex: 2 per value)
                offsets = np.concatenate([[0], np.cumsum(ragged_sizes(shapes, c))])
                group[c.key] = (values, offsets, shapes)
                nbytes += values.nbytes
            else:
                group[c.key] = self._get(c.name, row, n)
                nbytes += group[c.key].nbytes
        self._cache[row] = group
        self._cache_bytes[row] = nbytes
        self._cached_total += nbytes
        while self._cached_total > self.cache_bytes and len(self._cache) > 1:
            old, _ = self._cache.popitem(last=False)
            self._cached_total -= self._cache_bytes.pop(old)
        return group
