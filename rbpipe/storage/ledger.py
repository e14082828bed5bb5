"""The ledger: the only reader of a store's commit log (docs/STORAGE.md).

The commit log (``commitlog.py``: lines, checksums, the lock) is the store's source of truth; this module
turns its records into state, in one place:

* :class:`Ledger` (a live store handle): the schema, the live groups in commit order, their row index
  (``GroupIndex``), live bytes, the eviction mark, every commit id and member id ever committed, and
  retention (which groups an ``evict`` record drops). Whoever stores the bytes (a backend) is told what
  happened through :class:`LedgerEvents`, so that it can map, cache or delete files.
* :func:`scan` (catalogue, ``rbpipe inspect``, export): every group ever committed, moves applied, the
  eviction mark and the torn-tail report, in one read and without torch.

Records: ``schema`` (the first one counts), ``group`` (``seq``, ``n`` rows, ``loc`` where the backend put
them, ``bytes``, ``cid``/``mids``), ``evict`` (every group with ``seq <= upto``), ``move`` (a compaction
relocated live groups). See docs/FORMAT.md, "Commit log".
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from rbpipe.errors import StoreError
from rbpipe.storage.commitlog import CommitLog
from rbpipe.storage.format import COMMIT_LOG
from rbpipe.storage.group_index import GroupIndex


class LedgerEvents:
    """What a backend hears while the ledger replays records (every method optional; no-ops here).

    ``block_id`` is the one answer the ledger needs back: which readable unit (an Arrow record batch, a
    Zarr group) holds a group stored at ``loc``, so that the row index can send reads to it."""

    def block_id(self, loc: dict, n: int) -> int:
        return 0

    def on_schema(self, schema: Any) -> None:
        """The store's schema became known."""

    def on_commit(self, rec: dict) -> None:
        """Every group record, evicted or not (what was ever written where)."""

    def on_live(self, loc: dict, delta: int) -> None:
        """A live group arrived at (+1) or left (-1) ``loc``: readers let go of files with no live group."""

    def on_move(self, rec: dict) -> None:
        """A compaction relocated groups (``rec["groups"]``: ``[seq, new loc]`` pairs)."""


def tail_report(log: CommitLog) -> dict:
    """Damaged complete lines (a writer died mid-line) and an unterminated tail, as read so far."""
    return {"torn_commit_lines": log.torn_lines, "unterminated_commit_bytes": log.pending_bytes}


class Replay(NamedTuple):
    """A whole commit log read once (:func:`scan`)."""

    groups: dict[int, dict]  # seq -> group record (moves applied), evicted ones included, commit order
    evicted_upto: int  # groups with seq <= this are evicted
    tail: dict  # :func:`tail_report`
    schema: list | None = None  # the schema record's columns (JSON, as written), None before the first group

    def live(self) -> list[dict]:
        return [r for s, r in self.groups.items() if s > self.evicted_upto]


def scan(path: str | Path) -> Replay:
    """Every group record of the store at ``path`` (moves applied), its eviction mark, tail report and
    schema. Opens the log read-only (a store without one has committed nothing)."""
    try:
        log = CommitLog(Path(path) / COMMIT_LOG, read_only=True)
    except FileNotFoundError:
        return Replay({}, -1, {"torn_commit_lines": 0, "unterminated_commit_bytes": 0})
    try:
        recs = log.read_new()
        tail = tail_report(log)
    finally:
        log.close()
    evicted_upto = -1
    groups: dict[int, dict] = {}
    schema = None
    for r in recs:
        kind = r.get("t")
        if kind == "schema" and schema is None:
            schema = r["schema"]
        elif kind == "group":
            groups[r["seq"]] = r
        elif kind == "evict":
            evicted_upto = max(evicted_upto, r["upto"])
        elif kind == "move":
            for seq, loc in r["groups"]:
                if seq in groups:
                    groups[seq] = dict(groups[seq], loc=loc)
    return Replay(groups, evicted_upto, tail, schema)


class Ledger:
    """The state of one store handle, kept up to date from the commit log (see the module doc).

    Rows are numbered by *position* among the live groups in commit order: row 0 is the first row of the
    oldest live group, so an eviction shifts every later row down (sequence numbers never change)."""

    def __init__(self, path: Path, events: LedgerEvents | None = None, schema_copy: str = "") -> None:
        self.path = path
        self.log = CommitLog(path / COMMIT_LOG)
        self.events = events or LedgerEvents()
        self.schema_copy = schema_copy  # where a copy of the schema is kept (named when the log's is torn)
        self.schema: Any = None
        self.groups: OrderedDict[int, dict] = OrderedDict()  # seq -> group record of the live groups
        self.index = GroupIndex()  # their row positions
        self.live_bytes = 0
        self.commit_ids: set[str] = set()  # ids of committed groups (idempotent recovery writes)
        self.member_ids: set[str] = set()  # writer-supplied ids of committed rows (e.g. staging handles)
        self.evicted_upto = -1

    # -- replay -------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Apply what other processes committed since the last read (one ``fstat`` when nothing did)."""
        self.apply(self.log.read_new())

    def apply(self, records: list[dict]) -> None:
        ev = self.events
        for rec in records:
            kind = rec.get("t")
            if kind == "schema" and self.schema is None:
                from rbpipe.storage.columns import ColumnSet  # torch: only where a store is opened for data

                self.schema = ColumnSet.from_json(rec["schema"])
                ev.on_schema(self.schema)
            elif kind == "group":
                if self.schema is None:
                    raise self._no_schema_error()
                if "cid" in rec:
                    self.commit_ids.add(rec["cid"])
                self.member_ids.update(rec.get("mids", ()))
                ev.on_commit(rec)
                if rec["seq"] <= self.evicted_upto:
                    continue
                self.groups[rec["seq"]] = rec
                self.index.append(rec["seq"], rec["n"], ev.block_id(rec["loc"], rec["n"]), rec["loc"].get("row", 0))
                self.live_bytes += rec["bytes"]
                ev.on_live(rec["loc"], 1)
            elif kind == "evict":
                self.evicted_upto = max(self.evicted_upto, rec["upto"])
                while self.groups and next(iter(self.groups)) <= rec["upto"]:
                    gone = self.groups.popitem(last=False)[1]
                    self.live_bytes -= gone["bytes"]
                    ev.on_live(gone["loc"], -1)
                self.index.evict_upto(rec["upto"])
            elif kind == "move":
                groups = self.groups
                for seq, loc in rec["groups"]:
                    if int(seq) in groups:
                        ev.on_live(loc, 1)
                        ev.on_live(groups[int(seq)]["loc"], -1)
                        groups[int(seq)] = dict(groups[int(seq)], loc=loc)
                # self.groups is the dict `groups` names (a closure over a name rebound in the loop would be B023)
                self.index.relocate(lambda seq: (ev.block_id(self.groups[seq]["loc"], self.groups[seq]["n"]),
                                                 self.groups[seq]["loc"].get("row", 0)))
                ev.on_move(rec)

    def _no_schema_error(self) -> StoreError:
        """A group line with no valid schema line before it: the schema line was damaged after it was written
        (a writer killed mid-line is followed by a new schema line). Serving the store would say it is empty
        while groups are committed, and the next write would commit a second, possibly different, schema."""
        return StoreError(f"the commit log {str(self.path / COMMIT_LOG)!r} has committed groups but its schema line "
                          f"is unreadable ({self.log.torn_lines} damaged line(s)); restore {COMMIT_LOG} from a "
                          f"backup (a copy of the schema is in {self.schema_copy}) before using this store")

    def tail(self) -> dict:
        return tail_report(self.log)

    # -- commits ------------------------------------------------------------------------------------------
    def append(self, make: Callable[[int], dict | None]) -> dict | None:
        """Under the log's lock, after catching up: write ``make(seq)`` (None writes nothing)."""
        return self.log.append(make, self.apply)

    def commit_schema(self, schema: Any) -> None:
        """Record ``schema`` unless a schema line is there already (a concurrent first writer's wins)."""
        self.append(lambda seq: None if self.schema is not None else
                    {"t": "schema", "schema": schema.to_json(), "time": time.time()})

    def commit_group(self, record: dict, commit_id: str | None, member_ids: list[str] | None) -> dict | None:
        """Commit one group record; None (nothing written) when ``commit_id`` is committed already (a writer
        committed it and died before reporting it, and a recovery writes it again). Checked under the lock."""
        def make(seq):
            if commit_id is not None and commit_id in self.commit_ids:
                return None
            return {**record, "time": time.time(), **({"cid": commit_id} if commit_id else {}),
                    **({"mids": list(member_ids)} if member_ids else {})}

        return self.append(make)

    def evict_over(self, max_rows: int, max_bytes: int | None) -> bool:
        """Evict the oldest groups while the live ones exceed ``max_rows`` rows or ``max_bytes`` bytes (the
        newest group always stays); whether an ``evict`` record was written."""
        def over(rows: int, nbytes: int) -> bool:
            return rows > max_rows or (max_bytes is not None and nbytes > max_bytes)

        def make(seq):
            rows, nbytes, upto = self.index.rows, self.live_bytes, None
            for i, r in enumerate(self.groups.values()):  # oldest first; always keep the newest group
                if i == len(self.groups) - 1 or not over(rows, nbytes):
                    break
                rows -= r["n"]
                nbytes -= r["bytes"]
                upto = r["seq"]
            return None if upto is None else {"t": "evict", "upto": upto, "time": time.time()}

        if not over(self.index.rows, self.live_bytes):
            return False
        self.append(make)
        return True

    def evict_all(self) -> bool:
        """Evict every committed group (``ReplayBuffer.empty()``); whether there was any."""
        self.refresh()
        if not self.groups:
            return False
        last = max(self.groups)
        self.append(lambda seq: {"t": "evict", "upto": last, "time": time.time()})
        return True

    def move(self, groups: list[list]) -> None:
        """Record that a compaction relocated ``groups`` (``[seq, new loc]`` pairs)."""
        self.append(lambda seq: {"t": "move", "time": time.time(), "groups": groups})

    def close(self) -> None:
        self.log.close()
