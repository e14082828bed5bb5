"""The group catalogue: one parquet row per committed group under ``STORE/catalog/`` (DuckDB-readable).

Catalogue files are written under a temporary name and renamed (``fsutil.atomic_write``), so a glob never
sees half a file. They may lag the commit log by a few groups (a writer batches them: :class:`CatalogBuffer`);
:func:`read_catalog` completes them from the commit log (read through ``ledger.scan``), which is the source
of truth, and marks evicted groups ``live = False``.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rbpipe.errors import StoreError
from rbpipe.storage.format import CATALOG_DIR, read_meta
from rbpipe.storage.ledger import scan
from rbpipe.system.fsutil import atomic_write

LIST_COLUMNS = ("returns", "advantages", "collectors", "policy_versions", "lengths")


def summable(a: np.ndarray, dtype: str) -> np.ndarray:
    """Stored scalars as numbers to sum: bfloat16 is stored as its raw bits, whose sum means nothing."""
    return (a.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else a


def json_numbers(values: list) -> list:
    """``values`` with NaN and infinities as the strings "NaN", "Infinity" and "-Infinity": commit lines stay
    strict JSON (which has no such numbers) and ``float()`` reads the strings back as the same values."""
    if all(math.isfinite(x) for x in values):
        return values
    return [x if math.isfinite(x) else "NaN" if x != x else "Infinity" if x > 0 else "-Infinity" for x in values]


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
    final.parent.mkdir(exist_ok=True)  # deleted by hand: the catalogue is rebuilt from the log, into a new one
    # no fsync: the commit log is the source of truth, and repair_catalog rewrites what a crash lost
    atomic_write(final, lambda tmp: pq.write_table(table, tmp), fsync=False,
                 tmp_name="." + final.name + ".tmp")


def catalog_values(cols, schema, catalog_columns: dict) -> dict[str, list]:
    """One group's catalogue values (``cols``: its ``layout.GroupColumns``): per member, the sum of a
    column's elements ("value") or its first-dimension length ("length"), as strict-JSON numbers."""
    out = {}
    for name, (key, red) in catalog_columns.items():
        if key in cols.fixed:
            a = summable(cols.fixed[key], schema.by_key[key].dtype)
            if red == "value":
                wide = np.float64 if a.dtype.kind == "f" else None  # float16 sums overflow in float16
                out[name] = a.reshape(cols.n, -1).sum(1, dtype=wide).tolist()
            else:
                shape = schema.by_key[key].shape
                out[name] = [shape[0] if shape else 1] * cols.n
        elif key in cols.ragged:
            values, shapes = cols.ragged[key]
            if red == "length":
                out[name] = shapes[:, 0].tolist() if shapes.shape[1] else [1] * cols.n
            else:
                sizes = shapes.prod(1) if shapes.shape[1] else np.ones(len(shapes), np.int64)  # elements per row
                flat = summable(values.reshape(-1), schema.by_key[key].dtype)
                sizes = sizes * (flat.size // max(int(sizes.sum()), 1))
                csum = np.concatenate([[0], np.cumsum(flat, dtype=np.float64 if flat.dtype.kind == "f"
                                                      else np.int64)])
                ends = np.cumsum(sizes)
                out[name] = (csum[ends] - csum[ends - sizes]).tolist()
    return {name: json_numbers(v) for name, v in out.items()}


class CatalogBuffer:
    """A writer's catalogue rows not yet in a Parquet file: flushed as one file per ``every`` groups, or
    sooner once the oldest waited ``interval_s`` (few, large files, as each flush has a fixed cost, without letting
    a slow writer's catalogue fall far behind its commits)."""

    def __init__(self, store: Path, columns: dict, every: int, interval_s: float) -> None:
        self.store, self.columns, self.every, self.interval_s = store, columns, every, interval_s
        self.pending: list[dict] = []
        self.failed_at: float | None = None  # commit time at which the last flush failed

    def add(self, rec: dict) -> None:
        self.pending.append(rec)
        self.flush_due()

    def flush_due(self) -> None:
        """Flush when ``every`` rows wait or the oldest waited ``interval_s``. A flush that failed keeps its
        rows and is tried again ``interval_s`` later (not at every commit: each try costs a file write)."""
        if not self.pending:
            return
        now = self.pending[-1]["time"]
        if self.failed_at is not None and now - self.failed_at < self.interval_s:
            return
        if len(self.pending) >= self.every or now - self.pending[0]["time"] >= self.interval_s:
            try:
                self.flush()
            except OSError:
                self.failed_at = now
                raise

    def flush(self) -> None:
        if self.pending:
            write_catalog_rows(self.store, self.pending, self.columns)
            self.pending, self.failed_at = [], None


def read_catalog(path: str | os.PathLike) -> pa.Table:
    """All committed groups (one row each, commit order), including not-yet-flushed ones; ``live``
    is False for evicted groups."""
    path = Path(path)
    read_meta(path)
    replay = scan(path)
    return catalog_table(replay.groups, replay.evicted_upto)


def catalog_table(groups: dict[int, dict], evicted_upto: int = -1) -> pa.Table:
    """The catalogue (the ``groups`` view of ``rbpipe query``: one row per group, in ``groups``' order) of group
    records already read from a commit log (``seq`` -> record); ``live`` is False for ``seq <= evicted_upto``.
    For a reader that follows the log itself (``rbpipe view``) and needs exactly the columns
    :func:`read_catalog` gives."""
    names = sorted(set(LIST_COLUMNS) | {k for r in groups.values() for k in r.get("cat", {})})
    rows = [_row(r, names) for r in groups.values()]  # the commit log is the source of truth
    table = _table(rows, names) if rows else _table([], names)
    live = pa.array([r["seq"] > evicted_upto for r in rows], pa.bool_())
    return table.append_column("live", live)


# -- inspect ----------------------------------------------------------------------------------------------
#: the old ``--where`` language's FIELD_mean/_min/_max/_sum/_std, and the DuckDB list function that replaces it
_OLD_SUFFIX = {"mean": "list_avg", "min": "list_min", "max": "list_max", "sum": "list_sum", "std": "list_stddev_pop"}


def _where_hint(where: str, columns: list[str]) -> str:
    """How to write ``where`` in SQL: the old ``returns_mean``-style fields are translated in the hint."""
    m = re.search(r"\b([A-Za-z_]+)_(mean|min|max|sum|std)\b", where)
    if m and m.group(1) in columns:
        return f"write {_OLD_SUFFIX[m.group(2)]}({m.group(1)}) for {m.group(0)}"
    return "e.g. --where \"list_avg(returns) > 0.5\" or \"group_id = 3\""


def select_groups(table: pa.Table, where: str) -> pa.Table:
    """The rows of the catalogue ``table`` (the ``groups`` view) for which the SQL condition ``where`` holds,
    in commit order; DuckDB evaluates it, so anything DuckDB accepts in a WHERE clause works."""
    import duckdb

    con = duckdb.connect()
    try:
        con.register("groups", table)
        try:
            rel = con.sql(f"select * from groups where ({where}) order by seq")
            return (getattr(rel, "to_arrow_table", None) or rel.arrow)()  # DuckDB 2 / 1.x
        except duckdb.Error as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise StoreError(f"--where {where!r} is not a SQL condition over the groups view ({first}); "
                             f"{_where_hint(where, table.column_names)}; columns: "
                             f"{', '.join(table.column_names)}") from None
    finally:
        con.close()


def inspect_store(path: str | os.PathLike, *, where: str | None = None, group=None,
                  limit: int | None = 20) -> dict[str, Any]:
    """Summary of a store and its (filtered) live groups, members in stored order; for ``rbpipe inspect``.

    ``where`` is a DuckDB SQL condition over the ``groups`` view (``list_avg(returns) > 0.5``). Reads the
    commit log once and never imports torch, so it answers in well under a second on thousands of groups.
    """
    path = Path(path)
    meta = read_meta(path)
    groups, evicted_upto, tail, _ = scan(path)
    table = catalog_table(groups, evicted_upto)
    live = table.filter(table.column("live"))
    if where:
        live = select_groups(live, where)
    rows = live.to_pylist()
    out = [r for r in rows if group is None or str(r["group_id"]) == str(group)]
    if limit is not None:
        out = out[-limit:] if limit > 0 else []  # the latest groups
    committed = [r for s, r in groups.items() if s > evicted_upto]
    return {"store": str(path), "backend": meta["backend"], "format_version": meta["format_version"],
            "groups_committed": len(committed), "groups_evicted": sum(1 for s in groups if s <= evicted_upto),
            "rows": sum(r["n"] for r in committed), "torn_tail": tail, "groups_matched": len(out),
            "groups": out}


def repair_catalog(path: str | os.PathLike, *, drop_unreadable: bool = False) -> int:
    """Write catalogue rows for committed groups that no Parquet file holds yet; returns how many.

    Writers batch their catalogue rows, so a writer killed between flushes leaves committed groups that
    are in the commit log (the source of truth) but not yet in ``catalog/*.parquet``. The launcher runs
    this after every run and before a resume, so DuckDB/Polars users see every committed group.
    A catalogue file that cannot be read (damaged on disk: writers rename only whole files) raises a
    StoreError, or with ``drop_unreadable`` is renamed ``*.parquet.unreadable`` (out of the catalogue's
    glob) and its groups are written again from the commit log.
    """
    path = Path(path)
    read_meta(path)
    groups = scan(path).groups
    covered: set[int] = set()
    for f in sorted((path / CATALOG_DIR).glob("*.parquet")):
        covered.update(_catalog_seqs(f, drop_unreadable))
    missing = [groups[s] for s in sorted(groups) if s not in covered]
    if missing:
        names = {k for r in missing for k in r.get("cat", {})}
        write_catalog_rows(path, missing, names)
    return len(missing)


def _catalog_seqs(f: Path, drop_unreadable: bool) -> list[int]:
    """The ``seq`` column of one catalogue file; an unreadable file is refused or moved aside (no seqs)."""
    try:
        return pq.read_table(f, columns=["seq"]).column("seq").to_pylist()
    except (pa.ArrowException, OSError) as exc:
        if not drop_unreadable:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise StoreError(f"catalogue file {str(f)!r} is unreadable ({why}); its rows are rebuilt from the "
                             "commit log: run repair_catalog(store, drop_unreadable=True) (it renames the file "
                             "*.unreadable) or delete the file and run repair_catalog again") from None
    os.replace(f, f.with_name(f.name + ".unreadable"))
    return []
