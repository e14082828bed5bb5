"""The group catalogue: one parquet row per committed group under ``STORE/catalog/`` (DuckDB-readable).

Catalogue files are written under a temporary name and renamed, so a glob never sees half a file.
They may lag the commit log by a few groups (a writer batches them); :func:`read_catalog` completes them
from the commit log, which is the source of truth, and marks evicted groups ``live = False``.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rbpipe.errors import StoreError
from rbpipe.storage.commitlog import CommitLog
from rbpipe.storage.format import CATALOG_DIR, COMMIT_LOG, read_meta

LIST_COLUMNS = ("returns", "advantages", "collectors", "policy_versions", "lengths")


def _row(rec: dict, names) -> dict:
    loc = rec["loc"]
    row = {"seq": rec["seq"], "group_id": rec.get("gid"), "members": rec["n"],
           "commit_time": rec["time"], "segment": loc.get("seg"), "batch": loc.get("batch"),
           "first_row": loc.get("row", 0), "bytes": rec.get("bytes")}
    for name in names:
        row[name] = [float(x) for x in rec["cat"][name]] if name in rec.get("cat", {}) else None
    return row


def _table(rows: list[dict], names) -> pa.Table:
    gid_type = pa.float64() if any(isinstance(r["group_id"], float) for r in rows) else pa.int64()
    fields = [("seq", pa.int64()), ("group_id", gid_type), ("members", pa.int64()),
              ("commit_time", pa.float64()), ("segment", pa.string()), ("batch", pa.int64()),
              ("first_row", pa.int64()), ("bytes", pa.int64())]
    fields += [(n, pa.list_(pa.float64())) for n in names]
    schema = pa.schema(fields)
    return pa.Table.from_pylist(rows, schema=schema)


def write_catalog_rows(store: Path, records: list[dict], catalog_columns) -> None:
    names = sorted(set(catalog_columns) | set(LIST_COLUMNS))
    table = _table([_row(r, names) for r in records], names)
    first, last = records[0]["seq"], records[-1]["seq"]
    final = Path(store) / CATALOG_DIR / f"{first:012d}-{last:012d}-{os.getpid()}.parquet"
    tmp = final.with_name("." + final.name + ".tmp")
    pq.write_table(table, tmp)
    os.rename(tmp, final)


def _scan(path: Path):
    log = CommitLog(path / COMMIT_LOG)
    try:
        recs = log.read_new()
        tail = {"torn_commit_lines": log.torn_lines, "unterminated_commit_bytes": log.pending_bytes}
    finally:
        log.close()
    evicted_upto = max((r["upto"] for r in recs if r.get("t") == "evict"), default=-1)
    groups = {r["seq"]: r for r in recs if r.get("t") == "group"}
    for r in recs:
        if r.get("t") == "move":
            for seq, loc in r["groups"]:
                if seq in groups:
                    groups[seq] = dict(groups[seq], loc=loc)
    return groups, evicted_upto, tail


def read_catalog(path: str | os.PathLike) -> pa.Table:
    """All committed groups (one row each, commit order), including not-yet-flushed ones; ``live``
    is False for evicted groups."""
    path = Path(path)
    read_meta(path)
    groups, evicted_upto, _ = _scan(path)
    names = sorted(set(LIST_COLUMNS) | {k for r in groups.values() for k in r.get("cat", {})})
    rows = [_row(r, names) for r in groups.values()]  # the commit log is the source of truth
    table = _table(rows, names) if rows else _table([], names)
    live = pa.array([r["seq"] > evicted_upto for r in rows], pa.bool_())
    return table.append_column("live", live)


# -- inspect ----------------------------------------------------------------------------------------------
_COND = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(==|!=|<=|>=|<|>)\s*(-?[0-9.eE+-]+|nan)\s*$")
_AGG = {"mean": lambda xs: sum(xs) / len(xs) if xs else math.nan, "min": min, "max": max, "sum": sum,
        "std": lambda xs: (sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)) ** 0.5 if xs else math.nan}
_OPS = {"==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b,
        "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b}


def parse_where(where: str):
    """``FIELD OP NUMBER [and FIELD OP NUMBER ...]``; FIELD is group_id, members, seq, commit_time, or a
    list column with a suffix _mean/_min/_max/_sum/_std (e.g. ``returns_mean > 0.5``)."""
    conds = []
    for part in re.split(r"\s+and\s+", where.strip(), flags=re.IGNORECASE):
        m = _COND.match(part)
        if not m:
            raise StoreError(f"cannot parse filter {part!r}: write FIELD OP NUMBER, e.g. 'returns_mean > 0.5' "
                             "or 'group_id == 3', joined by 'and'")
        field, op, num = m.groups()
        try:
            value = float(num)
        except ValueError:
            raise StoreError(f"{num!r} in filter {part!r} is not a number") from None
        conds.append((field, op, value))
    return conds


def _field(g: dict, field: str):
    if field in g and not isinstance(g[field], list):
        return g[field]
    base, _, agg = field.rpartition("_")
    if base in g and isinstance(g[base], list) and agg in _AGG:
        return _AGG[agg](g[base]) if g[base] else math.nan
    known = sorted(k for k, v in g.items() if not isinstance(v, (list, str)) and v is not None)
    lists = sorted(k for k, v in g.items() if isinstance(v, list))
    raise StoreError(f"unknown filter field {field!r}; use one of {known} or a list column + _mean/_min/"
                     f"_max/_sum/_std ({lists})")


def inspect_store(path: str | os.PathLike, *, where: str | None = None, group=None,
                  limit: int | None = 20) -> dict[str, Any]:
    """Summary of a store and its (filtered) groups, members in stored order; for ``rbpipe inspect``."""
    path = Path(path)
    meta = read_meta(path)
    groups, evicted_upto, tail = _scan(path)
    table = read_catalog(path)
    rows = [r for r in table.to_pylist() if r["live"]]
    conds = parse_where(where) if where else []
    out = []
    for r in rows:
        if group is not None and str(r["group_id"]) != str(group):
            continue
        if all(_OPS[op](_field(r, f), v) for f, op, v in conds):
            out.append(r)
    if limit is not None:
        out = out[-limit:] if limit > 0 else []  # the latest groups
    return {"store": str(path), "backend": meta["backend"], "format_version": meta["format_version"],
            "groups_committed": len(rows), "groups_evicted": sum(1 for s in groups if s <= evicted_upto),
            "rows": sum(r["members"] for r in rows), "torn_tail": tail, "groups_matched": len(out),
            "groups": out}


def export_zarr(store_path: str | os.PathLike, out_path: str | os.PathLike) -> int:
    """Copy every live group of a store (either backend) into a new Zarr store; returns groups exported."""
    from rbpipe.storage import open_storage
    from rbpipe.storage.zarr_storage import ZarrStorage
    src = open_storage(store_path)
    spans = src.group_spans()
    if not len(spans):
        ZarrStorage(out_path)
        return 0
    dst = ZarrStorage(out_path, ragged_keys=[c.key for c in src.schema.columns if c.ragged],
                      group_key=src.group_key, catalog_columns=src.catalog_columns)
    for _, a, b in spans.tolist():
        dst.append_group(src.get(slice(a, b)))
    dst.close()
    return len(spans)


def repair_catalog(path: str | os.PathLike) -> int:
    """Write catalogue rows for committed groups that no Parquet file holds yet; returns how many.

    Writers batch their catalogue rows, so a writer killed between flushes leaves committed groups that
    are in the commit log (the source of truth) but not yet in ``catalog/*.parquet``. The launcher runs
    this after every run and before a resume, so DuckDB/Polars users see every committed group.
    """
    path = Path(path)
    read_meta(path)
    groups, _, _ = _scan(path)
    covered: set[int] = set()
    for f in (path / CATALOG_DIR).glob("*.parquet"):
        covered.update(pq.read_table(f, columns=["seq"]).column("seq").to_pylist())
    missing = [groups[s] for s in sorted(groups) if s not in covered]
    if missing:
        names = {k for r in missing for k in r.get("cat", {})}
        write_catalog_rows(path, missing, names)
    return len(missing)
