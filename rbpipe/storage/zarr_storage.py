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
from pathlib import Path

import numpy as np

from rbpipe.errors import StoreError
from rbpipe.storage.base import GroupStorage
from rbpipe.storage.format import ZARR_DIR
from rbpipe.storage.layout import GroupColumns, Schema

MAX_CHUNKS = 2 ** 18  # chunks per array (zarr indexing cost grows with the chunk count)
VALUE_CHUNK = 16384
ALLOC_FILE = "zarr_alloc.json"


class ZarrStorage(GroupStorage):
    """A torchrl ``Storage`` of whole groups in a Zarr v3 group (``STORE/data.zarr``); same API as
    :class:`ArrowStorage` (``compact()`` is a no-op). See ``docs/FORMAT.md``."""

    backend = "zarr"

    def _open_backend(self) -> None:
        self._zpath = self.path / ZARR_DIR
        self._arrays = None

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

    def _block_id(self, loc: dict) -> int:
        return 0

    def _gather(self, block, local_rows, keys=None) -> dict:
        out = {}
        rows = np.asarray(local_rows, np.int64)
        contiguous = len(rows) > 0 and rows[-1] - rows[0] == len(rows) - 1 and (np.diff(rows) == 1).all()
        sel = slice(int(rows[0]), int(rows[-1]) + 1) if contiguous else None

        def read(name):
            a = self._arr(name)
            if len(rows) == 0:
                return np.zeros((0, *a.shape[1:]), a.dtype)
            return a[sel] if sel is not None else a.get_orthogonal_selection((rows,))

        for c in self._schema.columns if keys is None else [self._schema.by_key[k] for k in keys]:
            if c.ragged:
                starts = read(c.name + ".start")
                shapes = read(c.name + ".shape")
                sizes = shapes.prod(1) if c.ndim else np.ones(len(rows), np.int64)
                if len(rows) and sizes.sum():
                    idx = np.concatenate([np.arange(s, s + k) for s, k in zip(starts.tolist(), sizes.tolist())])
                    lo, hi = int(idx.min()), int(idx.max()) + 1
                    a = self._arr(c.name + ".values")
                    if hi - lo == len(idx) and (np.diff(idx) == 1).all():
                        values = a[lo:hi]
                    else:
                        values = a.get_orthogonal_selection((idx,))
                else:
                    values = np.zeros((0,), c.np_dtype)
                ends = np.cumsum(sizes)
                trail = (2,) if c.complex else ()
                out[c.key] = [values[e - k:e].reshape(*s, *trail)
                              for e, k, s in zip(ends.tolist(), sizes.tolist(), shapes.tolist())]
            else:
                out[c.key] = read(c.name)
        return out

    def compact(self) -> int:
        """Nothing to do: Zarr rows are already addressable individually."""
        return 0
