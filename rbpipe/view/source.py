"""What the viewer shows, as plain JSON-ready dicts: pages of groups, one group's members, the plot's numbers.

One :class:`StoreView` per store serves the live server and the ``--html`` writer alike, so the page shows the
same thing in both. The groups come from the ``groups`` view of ``rbpipe query`` (``rbpipe.storage.query.groups_table``:
every committed group, complete at every commit) and filters are DuckDB conditions over it (and over the
``trajectories`` view through a subquery), evaluated server-side with ``LIMIT``/``OFFSET`` so that a page of a
100,000-group store costs the browser a hundred rows. Everything is read-only: the commit log is opened
``O_RDONLY`` and tailed, the writer lock is never taken, nothing is written to the store.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rbpipe.errors import StoreError
from rbpipe.rundir import RUN, STORE, SUMMARY
from rbpipe.view.rows import MemberReader

#: groups per page: what the browser renders at once, whatever the store holds
PAGE_SIZE = 100
#: the filter an empty box means
ALL = "true"
#: member columns shown first, in this order, when the store has them (the rest follow as the view has them)
MEMBER_ORDER = ("member", "text_response", "tokens_response", "next_reward", "advantage", "finish_reason",
                "tokens_prompt_len", "tokens_response_len", "collector_id", "policy_version")
#: fields of a member that are shown elsewhere (the prompt is the group's) or are the raw form of another
_HIDDEN = {"group_id", "text_prompt", "tokens_prompt", "seq"}
FILTER_HINT = ("write a SQL condition over the groups view, e.g. list_avg(returns) > 0.5, or over the "
               "trajectories view as seq in (select seq from trajectories where next_reward > 0)")


def resolve_store(path: str | os.PathLike) -> tuple[Path, Path | None]:
    """``(store, run directory or None)`` for PATH, a store or a run directory; a one-line error otherwise."""
    path = Path(path)
    if not path.exists():
        raise StoreError(f"{str(path)!r} does not exist: pass a store (runs/<run>/store) or a run directory "
                         "(runs/<run>)")
    if (path / "rbpipe-store.json").is_file():
        return path, None
    run_json = path / RUN
    if run_json.is_file():
        try:
            named = Path(json.loads(run_json.read_text())["store"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{str(run_json)!r} does not name the run's store ({exc}): pass the store "
                             "directory itself") from None
        for store in (named, path / named, path / STORE):
            if (store / "rbpipe-store.json").is_file():
                return store, path
        raise StoreError(f"the store of run {str(path)!r} ({str(named)!r}) is not there: pass the store "
                         "directory itself")
    if (path / STORE / "rbpipe-store.json").is_file():
        return path / STORE, path
    raise StoreError(f"{str(path)!r} is neither an rbpipe store (no rbpipe-store.json) nor a run directory "
                     "(no run.json or store/): pass a store (runs/<run>/store) or a run directory (runs/<run>)")


def _connect():
    """An in-memory DuckDB that cannot touch files: a filter is text from a browser, so ``COPY ... TO`` or
    ``read_csv('/etc/...')`` inside it must fail rather than write into (or read beside) the store."""
    import duckdb

    con = duckdb.connect(config={"enable_external_access": False})
    return con


def _catalog_rows(records: list[dict]) -> pa.Table:
    """The ``groups`` view's rows (without ``live``) of these group records, built by the catalogue's own
    code so that the columns are exactly those of ``rbpipe query`` (``rbpipe.storage.query.groups_table``)."""
    from rbpipe.storage import catalog_table

    table = catalog_table({r["seq"]: r for r in records})
    return table.drop_columns(["live"])


def _arrow(rel) -> pa.Table:
    return (getattr(rel, "to_arrow_table", None) or rel.arrow)()  # DuckDB 2 / 1.x


class StoreView:
    """A read-only, self-refreshing view of one store (thread-safe: the server calls it from many threads).

    Examples:
        >>> from rbpipe.view.source import StoreView
        >>> view = StoreView("runs/demo/store")            # doctest: +SKIP
        >>> view.page(where="list_avg(returns) > 0.5")["total"]   # doctest: +SKIP
        12
    """

    def __init__(self, store: str | os.PathLike, run_dir: str | os.PathLike | None = None) -> None:
        from rbpipe.storage.format import read_meta

        self.store = Path(store)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.backend = str(read_meta(self.store)["backend"])
        self._lock = threading.RLock()
        self._log: Any = None  # rbpipe.storage.commitlog.CommitLog, read-only, tailed
        self._records: dict[int, dict] = {}
        self._schema: list[dict] | None = None
        self._evicted_upto = -1
        self._version: tuple[int, int] = (-1, -1)
        self._groups: pa.Table | None = None  # the ``groups`` view: ``_base`` plus ``live``
        self._base: pa.Table | None = None
        self._pending: list[dict] = []  # group records read from the log, not yet in ``_base``
        self._moved = False
        self._con: Any = None  # one DuckDB connection (a new one is slow to open)
        self._trajectories: tuple[tuple[int, int], pa.Table] | None = None
        self._prompts: OrderedDict[int, tuple[str, Any]] = OrderedDict()
        self._reader: MemberReader | None = None

    # -- keeping up with writers -------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Read what writers committed since the last call (one ``stat`` when nothing); True if anything.

        The ``groups`` table grows by the new records only: rebuilding it from the whole log at every commit
        costs in proportion to the log, which a poll every 1.5 s during a run would pay again and again (figures:
        docs/DESIGN.md, Figures behind code choices)."""
        log_path = self.store / "commits.jsonl"
        with self._lock:
            try:
                st = os.stat(log_path)
                version = (st.st_size, st.st_mtime_ns)
            except FileNotFoundError:
                version = (0, 0)
            if version == self._version and self._groups is not None:
                return False
            self._tail()
            base = self._base
            if base is not None and self._pending and not self._moved:
                part = _catalog_rows(self._pending)
                base = pa.concat_tables([base, part]) if part.schema.equals(base.schema) else None
                if base is not None and base.column("seq").num_chunks > 64:
                    base = base.combine_chunks()
            if base is None or self._moved:  # first read, a compaction moved groups, or new catalogue columns
                base = _catalog_rows(list(self._records.values()))
            self._base, self._pending, self._moved = base, [], False
            self._groups = base.append_column("live", pc.greater(base.column("seq"), self._evicted_upto))
            self._version = version
            return True

    def table(self) -> pa.Table:
        """The ``groups`` view as this viewer sees it now (the rows ``rbpipe query`` gives for ``groups``)."""
        with self._lock:
            self.refresh()
            assert self._groups is not None
            return self._groups

    def _tail(self) -> None:
        from rbpipe.storage.commitlog import CommitLog

        if self._log is None:
            if not (self.store / "commits.jsonl").is_file():
                return
            self._log = CommitLog(self.store / "commits.jsonl", read_only=True)
        for rec in self._log.read_new():
            kind = rec.get("t")
            if kind == "schema" and self._schema is None:
                self._schema = rec["schema"]
                self._reader = MemberReader(self.store, self.backend, self._schema)
            elif kind == "group":
                self._records[rec["seq"]] = rec
                self._pending.append(rec)
            elif kind == "evict":
                self._evicted_upto = max(self._evicted_upto, rec["upto"])
            elif kind == "move":
                for seq, loc in rec["groups"]:
                    if int(seq) in self._records:
                        self._records[int(seq)] = dict(self._records[int(seq)], loc=loc)
                self._moved = True  # the catalogue's location columns change: rebuilt at the next refresh
                self._reader = MemberReader(self.store, self.backend, self._schema or [])  # new segment maps

    def close(self) -> None:
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None
            if self._con is not None:
                self._con.close()
                self._con = None

    # -- SQL -----------------------------------------------------------------------------------------------
    def _sql(self, sql: str, where: str) -> pa.Table:
        """Run ``sql`` (one statement embedding the user's condition) over the views; a condition that does not
        parse or bind is a one-line :class:`StoreError`."""
        import duckdb

        assert self._groups is not None
        if self._con is None:
            self._con = _connect()
        con = self._con
        try:
            if len(con.extract_statements(sql)) != 1:
                raise StoreError(f"filter {where!r} is not one SQL condition (it ends the statement); "
                                 + FILTER_HINT)
            con.register("groups", self._groups)
            if "trajectories" in where.lower():
                con.register("trajectories", self._trajectories_table())
            return _arrow(con.sql(sql))
        except duckdb.Error as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise StoreError(f"filter {where!r} failed: {first}; {FILTER_HINT}") from None

    def _trajectories_table(self) -> pa.Table:
        """The whole ``trajectories`` view, built only when a filter names it and kept until the store changes."""
        from rbpipe.storage.query import trajectories_table

        if self._trajectories is None or self._trajectories[0] != self._version:
            self._trajectories = (self._version, trajectories_table(self.store))
        return self._trajectories[1]

    @staticmethod
    def _cond(where: str | None) -> str:
        where = (where or "").strip()
        return where if where else ALL

    # -- what the page asks ----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Counts and the store's version: the page polls this and fetches a page only when it changed."""
        with self._lock:
            self.refresh()
            assert self._groups is not None
            g = self._groups  # counted with pyarrow: the page asks every 1.5 s, and a store may hold 100,000
            live = int(pc.sum(pc.cast(g.column("live"), pa.int64())).as_py() or 0)
            last = pc.max(g.column("seq")).as_py()
            return {"store": str(self.store), "backend": self.backend, "groups": g.num_rows,
                    "live": live, "evicted": g.num_rows - live,
                    "rows": int(pc.sum(g.column("members")).as_py() or 0),
                    "last_seq": -1 if last is None else last, "version": list(self._version),
                    "run": self._run_summary()}

    def _run_summary(self) -> dict[str, Any] | None:
        """The run's counts of groups that were never stored (dropped by the grouping), once its summary exists."""
        if self.run_dir is None:
            return None
        try:
            summary = json.loads((self.run_dir / SUMMARY).read_text())
        except (OSError, ValueError):
            return {"run_dir": str(self.run_dir), "status": "running or no summary yet"}
        keep = ("status", "groups_written", "groups_dropped", "drop_reasons", "learner_steps", "written", "dropped")
        return {"run_dir": str(self.run_dir), **{k: summary[k] for k in keep if k in summary}}

    def page(self, where: str | None = None, offset: int = 0, limit: int = PAGE_SIZE,
             upto: int | None = None) -> dict[str, Any]:
        """Groups matching ``where``, newest first, ``limit`` of them after ``offset``, among those with
        ``seq <= upto`` (the page the reader is on stays put while writers add groups; ``newer`` counts those)."""
        cond = self._cond(where)
        offset, limit = max(0, int(offset)), max(1, int(limit))
        with self._lock:
            self.refresh()
            head = self._sql(f"select count(*) as n, max(seq) as last from groups where ({cond})", cond)
            total_all, last = head.column("n")[0].as_py(), head.column("last")[0].as_py()
            upto = last if upto is None or upto < 0 or last is None else min(int(upto), last)
            upto = -1 if upto is None else upto
            bound = f"seq <= {upto} and ({cond})"
            total = self._sql(f"select count(*) as n from groups where {bound}", cond).column("n")[0].as_py()
            rows = self._sql(
                "select seq, group_id, members, live, list_avg(returns) as mean_reward, "
                "list_min(policy_versions) as version_min, list_max(policy_versions) as version_max, "
                f"commit_time from groups where {bound} order by seq desc limit {limit} offset {offset}",
                cond).to_pylist()
            for r in rows:
                r["prompt"], r["prompt_kind"] = self._prompt(r["seq"], r["live"])
            return {"where": "" if cond == ALL else cond, "offset": offset, "limit": limit, "upto": upto,
                    "total": total, "newer": total_all - total, "rows": [_plain(r) for r in rows]}

    def _prompt(self, seq: int, live: bool) -> tuple[str, str]:
        """The group's prompt as (text, kind): its text field, else torchrl's ``query`` string, else token ids."""
        if not live:
            return "", "evicted"
        if seq not in self._prompts:
            try:
                members = self._members(seq)
            except (StoreError, OSError, pa.ArrowException):  # evicted since the table was read: the next poll says
                return "", "evicted"
            first = members[0] if members else {}
            for key, kind in (("text_prompt", "text"), ("query", "text"), ("tokens_prompt", "tokens")):
                if first.get(key) is not None:
                    value = first[key]
                    self._prompts[seq] = (value if isinstance(value, str) else " ".join(map(str, value)), kind)
                    break
            else:
                self._prompts[seq] = ("", "none")
            while len(self._prompts) > 20_000:
                self._prompts.popitem(last=False)
        return self._prompts[seq]

    def _members(self, seq: int) -> list[dict[str, Any]]:
        if seq not in self._records:
            self._tail()
        rec = self._records.get(seq)
        if rec is None or self._reader is None:
            raise StoreError(f"no group with seq {seq} in {str(self.store)!r}")
        try:
            return self._reader.group(rec)
        except FileNotFoundError:  # compacted (moved) or evicted since: read the log again, once
            self._tail()
            if seq <= self._evicted_upto:
                raise StoreError(f"group seq {seq} was evicted from the store (retention): its rows are gone") from None
            assert self._reader is not None
            return self._reader.group(self._records[seq])

    def group(self, seq: int) -> dict[str, Any]:
        """One group: its catalogue row and its members (columns in display order)."""
        seq = int(seq)
        found = self.groups([seq])
        if seq not in found:
            raise StoreError(f"no group with seq {seq} in {str(self.store)!r}")
        return found[seq]

    def groups(self, seqs: list[int]) -> dict[int, dict[str, Any]]:
        """:meth:`group` of each of ``seqs`` that exists, with one SQL statement (the ``--html`` file holds
        thousands)."""
        if not seqs:
            return {}
        wanted = {int(s) for s in seqs}
        with self._lock:
            self.refresh()
            found = self._sql(
                "select seq, group_id, members, live, list_avg(returns) as mean_reward, returns, advantages, "
                f"policy_versions, collectors, commit_time from groups where seq between {min(wanted)} and "
                f"{max(wanted)}", ALL).to_pylist()
            out = {}
            for row in found:
                if row["seq"] in wanted:
                    out[row["seq"]] = self._group_doc(row)
            return out

    def _group_doc(self, row: dict[str, Any]) -> dict[str, Any]:
        row["prompt"], row["prompt_kind"] = self._prompt(row["seq"], row["live"])
        members = self._members(row["seq"]) if row["live"] else []
        names = [k for k in MEMBER_ORDER if any(k in m for m in members)]
        names += [k for m in members[:1] for k in m if k not in names and k not in _HIDDEN
                  and not isinstance(m[k], list)]
        return {"group": _plain(row), "columns": names,
                "members": [_plain({k: m.get(k) for k in names}) for m in members]}

    def plot(self, where: str | None = None) -> dict[str, Any]:
        """Per policy version: count, quartiles, extremes and mean of the members' rewards and advantages
        (from the ``groups`` view's per-member lists), over the live groups matching ``where``."""
        cond = self._cond(where)
        stats = ", ".join(f"min({c}) as {c}_min, quantile_cont({c}, 0.25) as {c}_q1, median({c}) as {c}_med, "
                          f"quantile_cont({c}, 0.75) as {c}_q3, max({c}) as {c}_max, avg({c}) as {c}_mean"
                          for c in ("r", "a"))
        with self._lock:
            self.refresh()
            table = self._sql(
                "with m as (select unnest(policy_versions) as v, unnest(returns) as r, unnest(advantages) as a "
                f"from groups where live and ({cond})) select v, count(*) as n, {stats} from m "
                "where v is not null group by v order by v", cond)
            return {"where": "" if cond == ALL else cond,
                    **{name: [_plain(x) for x in table.column(name).to_pylist()] for name in table.column_names}}


def _plain(value: Any) -> Any:
    """JSON-safe: NaN and infinities as null (strict JSON has none)."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
