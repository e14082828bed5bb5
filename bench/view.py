"""Viewer benchmark: what a page of ``rbpipe view`` costs on a large store, against the plain read path.

A store of N demo-like groups (8 members, token-only; written untimed) is read two ways, in one run:
* ``baseline``: ``rbpipe.storage.query.query`` per request, what a page would cost if it ran ``rbpipe query`` for each
  (every call re-reads the commit log; a group's members come from the whole ``trajectories`` view);
* ``ours``: one :class:`rbpipe.view.source.StoreView` as the server keeps it (the log read once, then a
  ``stat`` per poll; the page's groups' members read from their own record batches).
Ops: ``open`` (first page after start), ``page_first``, ``page_last`` (LIMIT/OFFSET at the end), ``filter``
(a condition over ``groups``), ``group`` (one group's members), ``plot`` (per-version spread), ``poll`` (the
page's 1.5 s check when nothing changed). Reported: the median of 5 calls (3 with ``--quick``) in seconds, and
the JSON bytes a page sends the browser. Nothing is asserted.

    python bench/view.py              # 100,000 groups (the store takes ~5 min to write on 2 cores)
    python bench/view.py --quick --json
    python bench/view.py --store runs/<run>/store   # an existing store
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _median(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _store(path: Path, groups: int) -> float:
    sys.path.insert(0, str(ROOT / "tests"))
    from view_helpers import token_group

    from rbpipe.storage import ArrowStorage
    from rbpipe.trajectory import RAGGED_KEYS

    t = time.perf_counter()
    made = [token_group(i, n=8) for i in range(64)]
    store = ArrowStorage(path, ragged_keys=RAGGED_KEYS)
    for i in range(groups):
        store.append_group(made[i % len(made)])
    store.close()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, help="groups in the store (default 100,000; 10,000 with --quick)")
    ap.add_argument("--store", type=Path, help="measure this existing store instead (read only, nothing written)")
    ap.add_argument("--reps", type=int, help="calls per op and side (default 5; 3 with --quick)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    n = args.groups or (10_000 if args.quick else 100_000)
    reps = args.reps or (3 if args.quick else 5)
    from rbpipe.storage.query import query
    from rbpipe.view.source import StoreView

    tmp = Path(tempfile.mkdtemp(prefix="rbpipe-bench-view-"))
    try:
        if args.store is not None:
            store, write_s = args.store, 0.0
            n = query(store, "select count(*) as n from groups").column("n")[0].as_py()
        else:
            store = tmp / "store"
            write_s = _store(store, n)
        cond = "list_avg(returns) > 0.5"
        head = "select seq, group_id, members, live, list_avg(returns) as r from groups"
        last_offset = (n - 1) // 100 * 100
        seq = n // 2
        baseline = {
            "open": lambda: query(store, f"{head} order by seq desc limit 100"),
            "page_first": lambda: query(store, f"{head} order by seq desc limit 100"),
            "page_last": lambda: query(store, f"{head} order by seq desc limit 100 offset {last_offset}"),
            "filter": lambda: query(store, f"{head} where {cond} order by seq desc limit 100"),
            "group": lambda: query(store, f"select * from trajectories where seq = {seq}"),
            "plot": lambda: query(store, "with m as (select unnest(policy_versions) v, unnest(returns) r from groups)"
                                         " select v, avg(r), min(r), max(r) from m group by v"),
            "poll": lambda: query(store, "select count(*), max(seq) from groups"),
        }
        view_box: list[StoreView] = []

        def fresh_open():
            view_box[:] = [StoreView(store)]
            view_box[0].page(None)

        ours = {
            "open": fresh_open,
            "page_first": lambda: view_box[0].page(None),
            "page_last": lambda: view_box[0].page(None, last_offset),
            "filter": lambda: view_box[0].page(cond),
            "group": lambda: view_box[0].group(seq),
            "plot": lambda: view_box[0].plot(None),
            "poll": lambda: view_box[0].state(),
        }
        results = []
        for op in baseline:
            b = _median(baseline[op], reps)
            o = _median(ours[op], reps)
            results.append({"op": op, "baseline_s": round(b, 5), "ours_s": round(o, 5), "ratio": round(b / o, 2)})
        page_bytes = len(json.dumps(view_box[0].page(None)))
        report = {"groups": n, "members_per_group": 8, "store_write_s": round(write_s, 1), "reps": reps,
                  "page_json_bytes": page_bytes, "results": results}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{n} groups x 8 members (store written in {report['store_write_s']} s); a page sends "
              f"{page_bytes / 1e3:.1f} KB of JSON")
        print(f"{'op':<12}{'baseline s':>12}{'ours s':>10}{'ratio':>8}")
        for r in results:
            print(f"{r['op']:<12}{r['baseline_s']:>12.4f}{r['ours_s']:>10.4f}{r['ratio']:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
