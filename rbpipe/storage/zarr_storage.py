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
from rbpipe.storage.layout import GroupColumns, Schema, ragged_sizes, take_ragged

MAX_CHUNKS = 2 ** 18  # chunks per array (zarr indexing cost grows with the chunk count)
VALUE_CHUNK = 16384
ALLOC_FILE = "zarr_alloc.json"


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
        """Reserve chunk-aligned row and value ranges for one group (fcntl lock, sidecar via os.replace)."""
        fd = os.open(self.path / ".alloc.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._create_arrays(cols.n)
            chunk_rows = int(self._zarr().attrs["chunk_rows"])
            path = self.path / ALLOC_FILE
            state = json.loads(path.read_text()) if path.exists() else {"rows": 0, "values": {}}
            row = state["rows"]
            state["rows"] = row + -(-cols.n // chunk_rows) * chunk_rows
            if state["rows"] > chunk_rows * MAX_CHUNKS:
                raise StoreError(f"the Zarr store {str(self.path)!r} is full ({chunk_rows * MAX_CHUNKS} rows "
                                 "of space); export to a new store or use the Arrow backend")
            vals = {}
            for c in self._schema.columns:
                if c.ragged:
                    start = state["values"].get(c.name, 0)
                    size = len(cols.ragged[c.key][0])
                    vals[c.name] = start
                    state["values"][c.name] = start + max(1, -(-size // VALUE_CHUNK)) * VALUE_CHUNK
                    if state["values"][c.name] > VALUE_CHUNK * MAX_CHUNKS:
                        raise StoreError(f"the Zarr store {str(self.path)!r} has no value space left for "
                                         f"{c.name!r}; export to a new store or use the Arrow backend")
            tmp = path.with_name(f".{ALLOC_FILE}.{os.getpid()}")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, path)
            return row, vals
        finally:
            os.close(fd)

    def _write_group(self, cols: GroupColumns) -> tuple[dict, int]:
        row, vals = self._allocate(cols)
        n = cols.n
        nbytes = 0
        for c in self._schema.columns:
            if c.ragged:
                values, shapes = cols.ragged[c.key]
                v0 = vals[c.name]
                sizes = shapes.prod(1) if c.ndim else np.ones(n, np.int64)
                starts = v0 + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
                if len(values):
                    self._arr(c.name + ".values")[v0:v0 + len(values)] = values
                self._arr(c.name + ".start")[row:row + n] = starts
                self._arr(c.name + ".shape")[row:row + n] = shapes
                nbytes += values.nbytes + shapes.nbytes
            else:
                self._arr(c.name)[row:row + n] = cols.fixed[c.key]
                nbytes += cols.fixed[c.key].nbytes
        return {"row": row, "vals": vals}, nbytes

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
