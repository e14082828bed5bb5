"""``ZarrStorage``: the same group store on Zarr v3 arrays (archive / export target, optional backend).

Zarr has no locking and rewrites a whole chunk on a partial write, so: each group gets a row range (and,
for ragged fields, a value range) allocated under an ``fcntl`` lock and rounded up to whole chunks, so no
two groups ever share a chunk; arrays are created once with a huge fixed shape (never ``append``/``resize``);
and the group becomes visible only through its commit-log line, written last.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from rbpipe.errors import StoreError
from rbpipe.storage.base import GroupStorage
from rbpipe.storage.format import ZARR_DIR
from rbpipe.storage.layout import GroupColumns, Schema, ragged_sizes, row_elements, take_ragged

MAX_CHUNKS = 2 ** 18  # chunks per array (zarr indexing cost grows with the chunk count)
VALUE_CHUNK = 16384
ALLOC_FILE = "zarr_alloc.json"
RESERVE_GROUPS = 32  # groups' worth of rows/values a writer process reserves per allocator visit


class _FileLock:
    """``with _FileLock(path):`` an exclusive ``fcntl`` lock (released by the kernel if the holder dies)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc) -> None:
        os.close(self._fd)


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


class ZarrStorage(GroupStorage):
    """A torchrl ``Storage`` of whole groups in a Zarr v3 group (``STORE/data.zarr``); same API as
    :class:`ArrowStorage` (``compact()`` is a no-op). See ``docs/FORMAT.md``."""

    backend = "zarr"

    cache_bytes = 256 * 2 ** 20  # decoded groups kept for sampling (per process)

    def _open_backend(self) -> None:
        self._zpath = self.path / ZARR_DIR
        self._arrays = None
        self._group_rows: dict[int, int] = {}  # first row -> rows of each committed group
        self._cache: OrderedDict[int, dict] = OrderedDict()
        self._cache_bytes: dict[int, int] = {}
        self._cached_total = 0
        self._raw_chunk_len: dict[str, int] = {}  # array -> rows per chunk, 0 where chunks are not raw bytes
        self._chunk_rows: int | None = None
        self._reserved, self._reserved_pid = None, os.getpid()

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
            self._arrays[name] = a
        return a

    def _create_arrays(self, chunk_rows: int) -> None:
        """Once per store, under the allocation lock."""
        g = self._zarr()
        if "__created" in g.attrs:
            return
        cap, vcap = chunk_rows * MAX_CHUNKS, VALUE_CHUNK * MAX_CHUNKS
        for c in self._schema.columns:
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
                        "schema": self._schema.to_json()})

    def _allocate(self, cols: GroupColumns) -> tuple[int, dict]:
        """Chunk-aligned row and value ranges for one group, from this process's reserved block.

        Under the lock a process reserves room for ``RESERVE_GROUPS`` groups at a time (the sidecar swap
        costs more than the group's own chunk writes); ranges are never handed out twice, and what a
        process leaves unused when it stops stays unused (holes read as zeros, no commit points at them).
        """
        if self._reserved_pid != os.getpid():
            self._reserved, self._reserved_pid = None, os.getpid()
        need_rows, need_vals = self._chunked_sizes(cols)
        r = self._reserved
        if r is None or r["rows"][0] + need_rows > r["rows"][1] or any(
                r["values"][name][0] + size > r["values"][name][1] for name, size in need_vals.items()):
            r = self._reserved = self._reserve(need_rows, need_vals)
        row = r["rows"][0]
        r["rows"][0] += need_rows
        vals = {}
        for name, size in need_vals.items():
            vals[name] = r["values"][name][0]
            r["values"][name][0] += size
        return row, vals

    def _chunked_sizes(self, cols: GroupColumns) -> tuple[int, dict[str, int]]:
        """Rows and (per ragged column) values the group occupies, rounded up to whole chunks."""
        if self._chunk_rows is None:
            self._create_arrays_locked(cols.n)
        rows = -(-cols.n // self._chunk_rows) * self._chunk_rows
        vals = {c.name: max(1, -(-len(cols.ragged[c.key][0]) // VALUE_CHUNK)) * VALUE_CHUNK
                for c in self._schema.columns if c.ragged}
        return rows, vals

    def _create_arrays_locked(self, chunk_rows: int) -> None:
        with self._alloc_lock():
            self._arrays = None  # re-read the group's attributes: another process may have created the arrays
            self._create_arrays(chunk_rows)
        self._chunk_rows = int(self._zarr().attrs["chunk_rows"])

    def _alloc_lock(self):
        return _FileLock(self.path / ".alloc.lock")

    def _reserve(self, need_rows: int, need_vals: dict[str, int]) -> dict:
        """Take the next block of rows and values (fcntl lock, sidecar swapped in with os.replace)."""
        with self._alloc_lock():
            cap = self._chunk_rows * MAX_CHUNKS
            path = self.path / ALLOC_FILE
            state = json.loads(path.read_text()) if path.exists() else {"rows": 0, "values": {}}
            row = state["rows"]
            take = max(need_rows, RESERVE_GROUPS * need_rows)
            if row + need_rows > cap:
                raise StoreError(f"the Zarr store {str(self.path)!r} is full ({cap} rows of space); export to "
                                 "a new store or use the Arrow backend")
            state["rows"] = min(cap, row + take)
            block = {"rows": [row, state["rows"]], "values": {}}
            for name, size in need_vals.items():
                start = state["values"].get(name, 0)
                if start + size > VALUE_CHUNK * MAX_CHUNKS:
                    raise StoreError(f"the Zarr store {str(self.path)!r} has no value space left for {name!r}; "
                                     "export to a new store or use the Arrow backend")
                state["values"][name] = min(VALUE_CHUNK * MAX_CHUNKS, start + max(size, RESERVE_GROUPS * size))
                block["values"][name] = [start, state["values"][name]]
            tmp = path.with_name(f".{ALLOC_FILE}.{os.getpid()}")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, path)
            return block

    def _write_group(self, cols: GroupColumns) -> tuple[dict, int]:
        row, vals = self._allocate(cols)
        n = cols.n
        nbytes = 0
        for c in self._schema.columns:
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
        return {"row": row, "vals": vals}, nbytes

    def _put(self, name: str, start: int, data: np.ndarray) -> None:
        """Write ``data`` at ``start`` (chunk-aligned, its chunks allocated to this group alone).

        Our arrays are uncompressed with zarr's default chunk keys, so a chunk *is* its raw little-endian
        bytes at ``NAME/c/I/0/...`` (Zarr v3 spec, ``bytes`` codec): whole chunks are written as files
        directly, which costs a file write instead of zarr-python's ~0.5-1 ms per indexing call. Any other
        array layout (made by another tool) goes through zarr."""
        arr = self._arr(name)
        chunk = self._raw_chunk_len.get(name)
        if chunk is None:
            chunk = self._raw_chunk_len[name] = _raw_chunk_rows(arr)
        if not chunk or start % chunk:
            arr[start:start + len(data)] = data
            return
        n, tail = len(data), data.shape[1:]
        whole = -(-n // chunk) * chunk
        buf = np.zeros((whole, *tail), dtype=arr.dtype.newbyteorder("<"))
        buf[:n] = data
        base = self._zpath / name / "c"
        suffix = "/0" * len(tail)  # the chunk index along every unchunked axis
        for k, first in enumerate(range(0, whole, chunk)):
            path = f"{base}/{start // chunk + k}{suffix}"
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, memoryview(buf[first:first + chunk]).cast("B"))
            finally:
                os.close(fd)

    def _block_id(self, loc: dict, n: int) -> int:
        """Each group is its own block: its first row (``_gather`` then reads and caches whole groups)."""
        self._group_rows[loc["row"]] = n
        return loc["row"]

    def _gather(self, block, local_rows, keys=None) -> dict:
        """Rows of one group. The group's columns are read whole (they are whole chunks) and kept in a
        bounded LRU cache of decoded groups: zarr-python pays ~0.3 ms per indexing call and keeps no
        cache, and committed groups never change, so a warm sample costs numpy slicing only."""
        if block is None:
            return {c.key: ((np.zeros(0, c.np_dtype), np.zeros((0, c.ndim), np.int64)) if c.ragged
                            else np.zeros((0, *c.shape), c.np_dtype)) for c in self._schema.columns}
        group = self._cache.get(block)
        if group is None:
            group = self._read_group(block, self._group_rows[block])
        else:
            self._cache.move_to_end(block)
        rows = np.asarray(local_rows, np.int64) - block
        out = {}
        for c in self._schema.columns if keys is None else [self._schema.by_key[k] for k in keys]:
            if c.ragged:
                out[c.key] = take_ragged(*group[c.key], c, rows)
            else:
                out[c.key] = group[c.key][rows]
        return out

    def _read_group(self, row: int, n: int) -> dict:
        group, nbytes = {}, 0
        for c in self._schema.columns:
            if c.ragged:
                starts = self._arr(c.name + ".start")[row:row + n]
                shapes = self._arr(c.name + ".shape")[row:row + n]
                total = int(ragged_sizes(shapes, c).sum()) // (2 if c.complex else 1)
                values = (self._arr(c.name + ".values")[int(starts[0]):int(starts[0]) + total] if total
                          else np.zeros((0, *((2,) if c.complex else ())), c.np_dtype))
                group[c.key] = (values.reshape(-1), shapes)
                nbytes += values.nbytes
            else:
                group[c.key] = self._arr(c.name)[row:row + n]
                nbytes += group[c.key].nbytes
        self._cache[row] = group
        self._cache_bytes[row] = nbytes
        self._cached_total += nbytes
        while self._cached_total > self.cache_bytes and len(self._cache) > 1:
            old, _ = self._cache.popitem(last=False)
            self._cached_total -= self._cache_bytes.pop(old)
        return group

    def compact(self) -> int:
        """Nothing to do: Zarr rows are already addressable individually."""
        return 0
