"""SQL over a store with DuckDB: two views, ``groups`` and ``trajectories``, built from the files alone.

Why a module of its own: ``rbpipe query`` answers questions people ask of a run ("how many trajectories",
"mean reward per policy version") with the tool they already use, DuckDB, without importing torch (which
costs seconds). Everything here reads the store as ``docs/FORMAT.md`` describes it: the commit log is the
source of truth, Arrow segments are read with pyarrow, Zarr arrays with zarr.

* ``groups``: one row per committed group, evicted ones included (``live`` says which), complete at every
  commit boundary (rebuilt from the commit log, not from the lagging Parquet files).
* ``trajectories``: one row per stored (live) trajectory: ``seq``, ``member`` (position in its group),
  every fixed one-element field (key parts joined with ``_``: ``next_reward``, ``advantage``...) and,
  for every ragged field, its first-dimension length as ``<name>_len`` (``tokens_response_len``); string
  fields (torchrl's ``"query"``, text) as their text.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from rbpipe.errors import StoreError

_SCALAR_DTYPES = {"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"}


def sql_name(column: str) -> str:
    """A store column name (``next.reward``) as a SQL identifier that needs no quoting (``next_reward``)."""
    return column.replace(".", "_")


def _read_log(store: Path) -> tuple[list[dict], list[dict], int]:
    """(schema columns, live group records in commit order with their current loc, evicted-up-to seq)."""
    from rbpipe.storage.ledger import scan  # torch-free

    if not (store / "commits.jsonl").is_file():
        raise StoreError(f"{str(store)!r} has no commits.jsonl: it is not a readable rbpipe store")
    replay = scan(store)
    return replay.schema or [], replay.live(), replay.evicted_upto


def _wanted(schema: list[dict]) -> list[dict]:
    """Columns the ``trajectories`` view shows: fixed fields of one element (``[]`` or ``[1]``, e.g. a reward)
    of a plain dtype, and every ragged field."""
    return [c for c in schema if c["shape"] is None
            or (int(np.prod(c["shape"])) == 1 and c["dtype"] in _SCALAR_DTYPES)]


def _arrow_columns(store: Path, cols: list[dict], live: list[dict]) -> dict[str, list[np.ndarray]]:
    """Per column, one numpy array per live group, read from the Arrow segments (memory-mapped)."""
    import pyarrow.ipc as ipc

    out: dict[str, list[np.ndarray]] = {c["column"]: [] for c in cols}
    maps: dict[str, tuple[pa.Buffer, pa.Schema]] = {}
    seg_dir = store / "segments"
    for rec in live:
        loc = rec["loc"]
        if loc["seg"] not in maps:
            path = seg_dir / (loc["seg"] + ".arrows")
            if not path.exists():
                path = seg_dir / (loc["seg"] + ".arrows.inprogress")
            with open(path, "rb") as f:
                buf = pa.py_buffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            maps[loc["seg"]] = (buf, ipc.read_schema(pa.BufferReader(buf)))
        buf, schema = maps[loc["seg"]]
        batch = ipc.read_record_batch(ipc.read_message(buf.slice(loc["off"], loc["len"])), schema)
        first = loc.get("row", 0)
        batch = batch.slice(first, rec["n"])
        for c in cols:
            if c["dtype"] == "str":
                out[c["column"]].append(np.asarray(batch.column(c["column"]).to_pylist(), dtype=object))
            elif c["shape"] is None:
                shape = batch.column(c["column"] + ".__shape")
                flat = shape.flatten().to_numpy(zero_copy_only=False).reshape(len(batch), -1)
                out[c["column"]].append(flat[:, 0] if flat.shape[1] else np.ones(len(batch), np.int64))
            else:
                col = batch.column(c["column"])
                if pa.types.is_fixed_size_list(col.type):
                    col = col.flatten()
                out[c["column"]].append(col.to_numpy(zero_copy_only=False))
    return out


def _zarr_columns(store: Path, cols: list[dict], live: list[dict]) -> dict[str, list[np.ndarray]]:
    """Per column, one numpy array per live group, read with plain zarr."""
    import zarr

    # zarr types a member as ``Array | Group``: every member read here is an array
    group: Any = zarr.open_group(str(store / "data.zarr"), mode="r") if live else None
    out: dict[str, list[np.ndarray]] = {c["column"]: [] for c in cols}
    for c in cols:
        arr: Any = group[c["column"] + (".shape" if c["shape"] is None else "")] if live else None
        for rec in live:
            row, n = rec["loc"]["row"], rec["n"]
            part = np.asarray(arr[row:row + n])
            if c["dtype"] == "str":  # UTF-8 bytes in c.values, each row from c.start for c.shape[0] bytes
                starts = np.asarray(group[c["column"] + ".start"][row:row + n])
                lo, hi = int(starts.min()), int((starts + part[:, 0]).max()) if n else 0
                data = bytes(np.asarray(group[c["column"] + ".values"][lo:hi])) if n else b""
                part = np.asarray([data[a - lo:a - lo + k].decode()
                                   for a, k in zip(starts.tolist(), part[:, 0].tolist(), strict=True)], object)
            elif c["shape"] is None:
                part = part[:, 0] if part.ndim == 2 and part.shape[1] else np.ones(n, np.int64)
            else:
                part = part.reshape(n)
            out[c["column"]].append(part)
    return out


def trajectories_table(store: str | os.PathLike) -> pa.Table:
    """One row per live trajectory (see the module docstring)."""
    store = Path(store)
    backend = _backend(store)
    schema, live, _ = _read_log(store)
    cols = _wanted(schema)
    read = _arrow_columns if backend == "arrow" else _zarr_columns
    data = read(store, cols, live)
    sizes = np.asarray([r["n"] for r in live], np.int64)
    arrays: dict[str, Any] = {
        "seq": np.repeat(np.asarray([r["seq"] for r in live], np.int64), sizes),
        "member": (np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)).astype(np.int64),
    }
    for c in cols:
        parts = data[c["column"]]
        empty = np.zeros(0, object if c["dtype"] == "str" else np.int64 if c["shape"] is None else "f8")
        merged = np.concatenate(parts) if parts else empty
        name = sql_name(c["column"]) + ("_len" if c["shape"] is None and c["dtype"] != "str" else "")
        if c["shape"] is not None and c["dtype"] == "bool":
            merged = merged.astype(bool)
        arrays.setdefault(name, merged)
    first = [k for k in ("seq", "group_id", "member") if k in arrays]
    return pa.table({k: arrays[k] for k in first + [k for k in arrays if k not in first]})


def groups_table(store: str | os.PathLike) -> pa.Table:
    """The catalogue, complete: one row per committed group, ``live`` False for evicted ones."""
    from rbpipe.storage.catalog import read_catalog

    return read_catalog(store)


def _backend(store: Path) -> str:
    try:
        meta = json.loads((store / "rbpipe-store.json").read_text())
    except FileNotFoundError:
        raise StoreError(f"{str(store)!r} is not an rbpipe store (no rbpipe-store.json): pass a store "
                         "directory, e.g. runs/<run>/store") from None
    except ValueError as exc:
        raise StoreError(f"the metadata of {str(store)!r} is unreadable ({exc})") from None
    return str(meta.get("backend"))


def query(store: str | os.PathLike, sql: str) -> pa.Table:
    """Run ``sql`` against the views ``groups`` and ``trajectories`` of ``store``; a bad statement raises
    :class:`StoreError` with DuckDB's one-line message."""
    import duckdb

    store = Path(store)
    _backend(store)
    con = duckdb.connect()
    try:
        lowered = sql.lower()
        if "groups" in lowered:
            con.register("groups", groups_table(store))
        if "trajectories" in lowered:
            con.register("trajectories", trajectories_table(store))
        try:
            relation = con.sql(sql)
            if relation is None:  # a statement that returns nothing (e.g. SET)
                return pa.table({})
            # DuckDB 2 calls it to_arrow_table; 1.x calls it arrow
            return (getattr(relation, "to_arrow_table", None) or relation.arrow)()
        except duckdb.Error as exc:
            first = str(exc).strip().splitlines()[0]
            raise StoreError(f"query failed: {first}; the views are 'groups' and 'trajectories' "
                             "(rbpipe query --help lists their columns)") from None
    finally:
        con.close()


def _plain(value: Any) -> Any:
    """A value as strict JSON allows: NaN and infinities become null, other types their ``str``."""
    if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        return None
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _rows(table: pa.Table) -> list[list[Any]]:
    """Rows as lists (``to_pylist`` gives dicts, which lose a column whose name repeats)."""
    return [list(r) for r in zip(*(c.to_pylist() for c in table.columns), strict=True)] if table.num_columns else []


def to_json(table: pa.Table) -> str:
    """One JSON document: ``{"columns": [names], "rows": [{name: value}, ...]}`` (strict JSON: NaN -> null)."""
    rows = [{k: _plain(v) for k, v in zip(table.column_names, r, strict=True)} for r in _rows(table)]
    return json.dumps({"columns": table.column_names, "rows": rows}, allow_nan=False)


def to_csv(table: pa.Table) -> str:
    """CSV with a header line; list cells are written as JSON arrays."""
    import csv
    import io

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(table.column_names)
    for r in _rows(table):
        writer.writerow([json.dumps(_plain(v)) if isinstance(v, (list, dict)) else "" if v is None else v
                         for v in r])
    return buf.getvalue()

