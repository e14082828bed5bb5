"""Shared grouping throughput: torchrl's stock shared MCAdvantage vs rbpipe's, and the no-IPC ceiling.

Same workload for all three: W writer processes (``multiprocess`` spawn) push trajectories whose groups span
writers, through a replay buffer whose storage is a ``LazyMemmapStorage`` allocated in the parent.
  stock    ``ReplayBuffer(shared=True)`` + torchrl ``MCAdvantage`` (stdlib manager, one RLock)
  ours     ``rbpipe.buffer.make_replay_buffer(grouping="rbpipe")`` (handles through a multiprocess manager;
           payloads staged in shared memory, ``/dev/shm``, as the transform does by default)
  ceiling  one process, torchrl ``MCAdvantage`` with process-local queues (no IPC at all)
Each (impl, W, G, payload) runs for a fixed time (or a trajectory cap); stock is slow, so it gets the same
time window and therefore far fewer trajectories. Speed is printed, never asserted.

  python bench/grouping.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import multiprocess  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl._utils import logger as _torchrl_logger  # noqa: E402

_torchrl_logger.setLevel("WARNING")  # torchrl logs storage allocation to stdout; --json owns stdout

PAYLOADS = ("16x64", "tok1024")
KEYS = ("group_id", ("next", "reward"), ("next", "done"))


def make_traj(payload: str, group: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    steps = 16 if payload == "16x64" else 1
    done = torch.zeros(steps, 1, dtype=torch.bool)
    done[-1] = True
    td = TensorDict({"group_id": torch.full((steps,), group, dtype=torch.int64),
                     "next": TensorDict(reward=torch.rand(steps, 1, generator=g), done=done, batch_size=[steps])},
                    batch_size=[steps])
    if payload == "16x64":
        td.set("obs", torch.rand(steps, 64, generator=g))
    else:
        td.set("tokens", torch.randint(0, 32000, (1, 1024), generator=g))
        td.set("log_probs", -torch.rand(1, 1024, generator=g))
    return td


from rbpipe.grouping.staging import temporary_staging_parent  # noqa: E402

#: ours stages payloads in shared memory (``/dev/shm``), the transform's default when no staging_dir is given
STAGING_ROOT = Path(tempfile.gettempdir())
WARMUP = (16, 0.3)  # untimed trajectories per writer (at most, and at most this many seconds) before each window


def run_config(buffer, payload: str, group_size: int, writers: int, w: int, base: int, seconds: float,
               cap: int, warmup: tuple[int, float] = WARMUP) -> list[float]:
    """Push this writer's trajectories for ``seconds`` (or ``cap`` of them); return per-trajectory latencies.

    Every implementation first pushes a few untimed trajectories into groups of their own: a process's first
    calls (manager connection, first allocations, lazy imports) are start-up cost, not throughput."""
    if warmup[0]:
        run_config(buffer, payload, group_size, writers, w, base + 5_000_000, warmup[1], warmup[0], (0, 0.0))
    lat = []
    trajs = [make_traj(payload, base + (k * writers + w) // group_size, k * 131 + w) for k in range(min(cap, 64))]
    deadline = time.perf_counter() + seconds
    k = 0
    while k < cap and time.perf_counter() < deadline:
        td = trajs[k % len(trajs)]
        td.set("group_id", torch.full_like(td.get("group_id"), base + (k * writers + w) // group_size))
        t0 = time.perf_counter()
        buffer.extend(td)
        lat.append(time.perf_counter() - t0)
        k += 1
    return lat


def writer_main(w: int, writers: int, configs, barrier, results, seconds: float, cap: int) -> None:
    torch.set_num_threads(1)
    for i, (buffer, payload, group_size, base) in enumerate(configs):
        barrier.wait()
        t0 = time.perf_counter()
        lat = run_config(buffer, payload, group_size, writers, w, base, seconds, cap)
        results.put((i, w, t0, time.perf_counter(), lat))


def summarize(impl, writers, group_size, payload, per_writer) -> dict:
    lat = sorted(x for _, _, lats in per_writer for x in lats)
    span = max(e for _, e, _ in per_writer) - min(s for s, _, _ in per_writer)
    q = lambda p: round(1000 * lat[min(len(lat) - 1, int(p * len(lat)))], 3) if lat else None  # noqa: E731
    return {"impl": impl, "writers": writers, "group_size": group_size, "payload": payload,
            "traj_per_s": round(len(lat) / span, 1) if lat else 0.0, "p50_ms": q(0.5), "p99_ms": q(0.99),
            "trajectories": len(lat)}


def make_storage(payload: str, group_size: int, capacity_traj: int, root: Path):
    from torchrl.data import LazyMemmapStorage

    from rbpipe.buffer import allocate_storage

    steps = 16 if payload == "16x64" else 1
    storage = LazyMemmapStorage(capacity_traj * steps, scratch_dir=root / f"{payload}-{group_size}-{time.time_ns()}")
    example = make_traj(payload, 0, 0)
    example.set("advantage", torch.zeros(steps, 1))
    allocate_storage(storage, example)
    return storage


def build_buffer(impl: str, payload: str, group_size: int, capacity: int, root: Path, manager):
    from torchrl.data import ReplayBuffer
    from torchrl.objectives.llm import MCAdvantage

    from rbpipe.buffer import make_replay_buffer

    storage = make_storage(payload, group_size, capacity, root)
    if impl == "ours":
        return make_replay_buffer(storage, grouping="rbpipe", grpo_size=group_size, manager=manager,
                                  staging_dir=STAGING_ROOT / "staging", required_keys=KEYS)
    if impl == "stock":
        return make_replay_buffer(storage, grouping="torchrl", grpo_size=group_size)
    return ReplayBuffer(storage=storage, transform=MCAdvantage(group_size, prompt_key="group_id"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short time windows (whole run < 90 s)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    seconds = 0.6 if args.quick else 4.0
    cap_ours, cap_stock = (2000, 200) if args.quick else (20000, 2000)
    writer_counts, sizes = (1, 2, 4), (4, 16, 64)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    from rbpipe.buffer import start_manager

    global STAGING_ROOT
    root = Path(tempfile.mkdtemp(prefix="rbpipe-bench-grouping-"))
    STAGING_ROOT = Path(tempfile.mkdtemp(prefix="rbpipe-bench-staging-", dir=temporary_staging_parent()))
    results = []
    manager = start_manager()
    ctx = multiprocess.get_context("spawn")
    try:
        for payload in PAYLOADS:  # ceiling: one process, local queues
            for g in sizes:
                buf = build_buffer("ceiling", payload, g, cap_ours + 64, root, None)
                t0 = time.perf_counter()
                lat = run_config(buf, payload, g, 1, 0, 0, seconds, cap_ours)
                results.append(summarize("ceiling", 1, g, payload, [(t0, time.perf_counter(), lat)]))
                log(results[-1])
        for impl, cap in (("ours", cap_ours), ("stock", cap_stock)):
            configs = [(build_buffer(impl, p, g, cap * len(writer_counts) * 4 + 64, root, manager), p, g)
                       for p in PAYLOADS for g in sizes]
            for wi, writers in enumerate(writer_counts):
                run_cfgs = [(b, p, g, (wi + 1) * 10_000_000) for b, p, g in configs]
                barrier, queue = ctx.Barrier(writers), ctx.Queue()
                procs = [ctx.Process(target=writer_main, args=(w, writers, run_cfgs, barrier, queue, seconds, cap),
                                     daemon=True) for w in range(writers)]
                for p in procs:
                    p.start()
                got: dict[int, list] = {}
                for _ in range(writers * len(run_cfgs)):
                    i, w, s, e, lat = queue.get(timeout=300)
                    got.setdefault(i, []).append((s, e, lat))
                for p in procs:
                    p.join(30)
                for i, (_, p_, g, _) in enumerate(run_cfgs):
                    results.append(summarize(impl, writers, g, p_, got[i]))
                    log(results[-1])
    finally:
        manager.shutdown()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(STAGING_ROOT, ignore_errors=True)
    if args.json:
        print(json.dumps({"results": results}))
    else:
        print_table(results)
    return 0


def print_table(results: list[dict]) -> None:
    by = {(r["impl"], r["writers"], r["group_size"], r["payload"]): r for r in results}
    print(f"{'payload':8} {'G':>3} {'W':>2} {'stock/s':>9} {'ours/s':>9} {'ceiling/s':>9} {'ours/stock':>10} "
          f"{'ours/ceil':>9} {'ours p50':>9} {'ours p99':>9} {'stock p50':>9}")
    for (impl, w, g, p), r in sorted(by.items(), key=lambda kv: (kv[0][3], kv[0][2], kv[0][1])):
        if impl != "ours":
            continue
        s, c = by.get(("stock", w, g, p)), by.get(("ceiling", 1, g, p))
        ratio = lambda a, b: f"{a / b:.{1 if a >= 10 * b else 2}f}x" if a and b else "-"  # noqa: E731
        print(f"{p:8} {g:>3} {w:>2} {s['traj_per_s'] if s else '-':>9} {r['traj_per_s']:>9} "
              f"{c['traj_per_s'] if c else '-':>9} {ratio(r['traj_per_s'], s and s['traj_per_s']):>10} "
              f"{ratio(r['traj_per_s'], c and c['traj_per_s']):>9} {r['p50_ms']:>9} {r['p99_ms']:>9} "
              f"{s['p50_ms'] if s else '-':>9}")


if __name__ == "__main__":
    raise SystemExit(main())
