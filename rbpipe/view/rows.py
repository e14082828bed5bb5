"""The member rows of a few groups, read straight from a store's files (docs/FORMAT.md), without torch.

Why not ``rbpipe.storage.query.trajectories_table``: it reads every live group to build the whole view, and a page
of the viewer needs ten to a hundred groups of a store that may hold 100,000; it also keeps only the length
of a token field, where the viewer shows the token ids of a prompt or a response. Column names are those of
the ``trajectories`` view (``next_reward``, ``tokens_response_len``, string fields as their text), so a
column another writer adds (``text_response``, ``finish_reason``) shows up here as it does in SQL.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from rbpipe.storage.query import sql_name

#: token ids kept per ragged field and row for display (a long response is cut, and says so)
MAX_VALUES = 2048
_PLAIN = {"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bfloat16"}


def _scalars(values: np.ndarray, dtype: str) -> list:
    """Stored scalars as Python numbers: bool is stored as uint8, bfloat16 as its raw bits."""
    if dtype == "bfloat16":
        values = (values.astype(np.uint32) << 16).view(np.float32)
    elif dtype == "bool":
        values = values.astype(bool)
    return values.tolist()


def _shown(col: dict) -> bool:
    """What the ``trajectories`` view shows: one-element fixed fields of a plain dtype, ragged and str fields."""
    return col["shape"] is None or (int(np.prod(col["shape"])) == 1 and col["dtype"] in _PLAIN)


class MemberReader:
    """Reads whole groups' members of one store; segment maps are kept open (a page reads many groups of few
    segments). Not thread-safe: one per request, or behind a lock."""

    def __init__(self, store: Path, backend: str, schema: list[dict]) -> None:
        self.store, self.backend = store, backend
        self.columns = [c for c in schema if _shown(c)]
        self._maps: dict[str, tuple[pa.Buffer, pa.Schema]] = {}
        self._zarr: Any = None

    def group(self, rec: dict) -> list[dict[str, Any]]:
        """One dict per member of the group record ``rec`` (``member``, then the view's columns; a ragged
        integer field also as ``<name>`` with its first :data:`MAX_VALUES` values)."""
        cols = self._arrow(rec) if self.backend == "arrow" else self._zarr_group(rec)
        return [{"member": i, **{k: v[i] for k, v in cols.items()}} for i in range(rec["n"])]

    # -- Arrow: one record batch per group ---------------------------------------------------------------
    def _batch(self, loc: dict) -> pa.RecordBatch:
        import pyarrow.ipc as ipc

        cached = self._maps.get(loc["seg"])
        if cached is None or cached[0].size < loc["off"] + loc["len"]:  # new, or grown since it was mapped
            path = self.store / "segments" / (loc["seg"] + ".arrows")
            if not path.exists():
                path = path.with_name(path.name + ".inprogress")
            with open(path, "rb") as f:
                buf = pa.py_buffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            self._maps[loc["seg"]] = (buf, ipc.read_schema(pa.BufferReader(buf)))
        buf, schema = self._maps[loc["seg"]]
        return ipc.read_record_batch(ipc.read_message(buf.slice(loc["off"], loc["len"])), schema)

    def _arrow(self, rec: dict) -> dict[str, list]:
        batch = self._batch(rec["loc"]).slice(rec["loc"].get("row", 0), rec["n"])
        out: dict[str, list] = {}
        for c in self.columns:
            name = sql_name(c["column"])
            if c["dtype"] == "str":
                out[name] = batch.column(c["column"]).to_pylist()
            elif c["shape"] is None:
                shapes = batch.column(c["column"] + ".__shape").to_pylist()
                out[name + "_len"] = [s[0] if s else 1 for s in shapes]
                if c["dtype"].startswith(("int", "uint")):
                    out[name] = [_scalars(np.asarray(v[:MAX_VALUES]), c["dtype"])
                                 for v in batch.column(c["column"]).to_pylist()]
            else:
                col = batch.column(c["column"])
                if pa.types.is_fixed_size_list(col.type):
                    col = col.flatten()
                out[name] = _scalars(col.to_numpy(zero_copy_only=False), c["dtype"])
        return out

    # -- Zarr: fixed rows at loc.row, ragged values at c.start -------------------------------------------
    def _zarr_group(self, rec: dict) -> dict[str, list]:
        import zarr

        if self._zarr is None:
            self._zarr = zarr.open_group(str(self.store / "data.zarr"), mode="r")
        z, row, n = self._zarr, rec["loc"]["row"], rec["n"]
        out: dict[str, list] = {}
        for c in self.columns:
            name = sql_name(c["column"])
            if c["shape"] is not None:
                out[name] = _scalars(np.asarray(z[c["column"]][row:row + n]).reshape(n), c["dtype"])
                continue
            shapes = np.asarray(z[c["column"] + ".shape"][row:row + n]).reshape(n, -1)
            starts = np.asarray(z[c["column"] + ".start"][row:row + n]).reshape(n).tolist()
            firsts = shapes[:, 0].tolist() if shapes.shape[1] else [1] * n
            if c["dtype"] == "str":
                values = z[c["column"] + ".values"]
                out[name] = [bytes(np.asarray(values[a:a + k])).decode() for a, k in zip(starts, firsts, strict=True)]
                continue
            out[name + "_len"] = firsts
            if c["dtype"].startswith(("int", "uint")):
                sizes = shapes.prod(1) if shapes.shape[1] else np.ones(n, np.int64)
                values = z[c["column"] + ".values"]
                out[name] = [_scalars(np.asarray(values[a:a + min(int(k), MAX_VALUES)]), c["dtype"])
                             for a, k in zip(starts, sizes.tolist(), strict=True)]
        return out
