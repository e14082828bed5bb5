"""The grouping path on the Ray engine beside the local engine: trajectories/s, per-shard ceiling, bytes.

Workload (both engines the same): W writers push ``16x64`` trajectories (``bench/grouping.py``'s) whose groups
of G=8 span the writers, through ``make_replay_buffer`` over an Arrow store: validate, stage the payload on disk
(the store's ``staging/``), one registry call per trajectory, the writer that completes a group reads its
members back and commits it to the store.
  local   writers are ``multiprocess`` spawn processes, the registry lives in the ``multiprocess`` manager
  ray     writers are Ray actors, the registry is K shard actors (``--grouping-shards K``, each logging its
          state changes as the service's do) plus the coordinator actor as lease authority, all in one private
          Ray instance on loopback
Then, for the paper model of docs/RAY.md: one shard actor's ceiling (appends/s it answers when callers
keep it busy, no payloads) and the bytes of one append message and its answer. Speed is printed, never
asserted; baseline (local) and Ray cells run in the same session, ratios are Ray/local at the same W.

  python bench/scale.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rbpipe.service.ray import use_loopback  # noqa: E402

use_loopback()  # before Ray is imported (torchrl imports it when installed): a private instance on lo only

import torch  # noqa: E402
from grouping import KEYS, run_config  # noqa: E402

G = 8
PAYLOAD = "16x64"


def _buffer(root: Path, manager, name: str):
    from rbpipe.buffer import make_replay_buffer
    from rbpipe.storage import ArrowStorage

    storage = ArrowStorage(root / f"store-{name}", group_key="group_id")
    return make_replay_buffer(storage, grpo_size=G, manager=manager, staging_dir=root / f"store-{name}" / "staging",
                              name=name, required_keys=KEYS)


def _local_writer(buffer, writers: int, w: int, seconds: float, out) -> None:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    lat = run_config(buffer, PAYLOAD, G, writers, w, 0, seconds, 10**9)
    out.put((t0, time.perf_counter(), len(lat)))


class _RayWriter:
    def go(self, buffer, writers: int, w: int, seconds: float):
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        lat = run_config(buffer, PAYLOAD, G, writers, w, 0, seconds, 10**9)
        buffer.grouping_transform.close()
        return t0, time.perf_counter(), len(lat)

    def ready(self) -> bool:
        import rbpipe.buffer  # noqa: F401 - imports (torch, torchrl) out of the timed window

        return True


def _rate(parts) -> float:
    span = max(e for _, e, _ in parts) - min(s for s, _, _ in parts)
    return round(sum(n for _, _, n in parts) / span, 1)


def bench_local(writers_list, seconds: float, root: Path) -> list[dict]:
    import multiprocess

    from rbpipe.grouping import start_manager

    manager = start_manager()
    ctx = multiprocess.get_context("spawn")
    results = []
    try:
        for w_count in writers_list:
            buffer = _buffer(root, manager, f"local-{w_count}")
            out = ctx.Queue()
            procs = [ctx.Process(target=_local_writer, args=(buffer, w_count, w, seconds, out), daemon=True)
                     for w in range(w_count)]
            for p in procs:
                p.start()
            parts = [out.get(timeout=seconds + 120) for _ in procs]
            for p in procs:
                p.join(30)
            results.append({"engine": "local", "writers": w_count, "shards": None, "traj_per_s": _rate(parts)})
    finally:
        manager.shutdown()
    return results


def bench_ray(writers_list, shards_list, seconds: float, root: Path) -> tuple[list[dict], dict]:
    import ray

    from rbpipe.service.ray import RayManager

    ray.init(num_cpus=max(writers_list), include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level="WARNING")
    results = []
    try:
        actors = [ray.remote(_RayWriter).options(num_cpus=1).remote() for _ in range(max(writers_list))]
        ray.get([a.ready.remote() for a in actors])
        for k in shards_list:
            manager = RayManager.start(shards=k, log_dir=str(root))  # as the service runs them: logging
            try:
                for w_count in writers_list:
                    buffer = _buffer(root, manager, f"ray-{k}-{w_count}")
                    parts = ray.get([actors[w].go.remote(buffer, w_count, w, seconds) for w in range(w_count)])
                    results.append({"engine": "ray", "writers": w_count, "shards": k, "traj_per_s": _rate(parts)})
            finally:
                manager.shutdown()
        ceiling = shard_ceiling(root)
    finally:
        ray.shutdown()
    return results, ceiling


def shard_ceiling(root: Path, n: int = 3000, window: int = 200) -> dict:
    """One shard actor kept busy (``window`` appends in flight): appends/s it answers; bytes per message."""
    import ray

    from rbpipe.grouping.registry import encode_tensor
    from rbpipe.service.ray import RayManager

    manager = RayManager.start(shards=1, log_dir=str(root))
    try:
        manager.get_registry("ceiling", {"grpo_size": G}, staging={"path": str(root / "none"), "temporary": False})
        shard, token = manager.shard_actors[0], manager.coordinator_actor.lease.remote()
        token = ray.get(token)
        ray.get(shard.adopt.remote(token))
        reward = encode_tensor(torch.rand(16, 1))
        args = lambda i: ("ceiling", "append", (i // G, f"w0/{i:012d}", reward, token, False), {})  # noqa: E731
        request = pickle.dumps(args(12345))
        answer = ray.get(shard.call.remote(*args(0)))
        ray.get([shard.call.remote(*args(i)) for i in range(1, 200)])  # warm
        t0 = time.perf_counter()
        pending = []
        for i in range(200, 200 + n):
            pending.append(shard.call.remote(*args(i)))
            if len(pending) >= window:
                ready, pending = ray.wait(pending, num_returns=window // 2)
        ray.get(pending)
        busy = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(200 + n, 400 + n):
            ray.get(shard.call.remote(*args(i)))
        rtt = (time.perf_counter() - t0) / 200
        t0 = time.perf_counter()
        pending = []
        for _ in range(n):  # Ray's own floor: the same actor, a method that does nothing
            pending.append(shard.pid.remote())
            if len(pending) >= window:
                ready, pending = ray.wait(pending, num_returns=window // 2)
        ray.get(pending)
        noop = time.perf_counter() - t0
        confirm = pickle.dumps(("ceiling", "confirm", ("0" * 32,), {}))
        group = [ray.get(shard.call.remote("ceiling", "append", (-1, f"w0/{i:012d}", reward, token, False), {}))
                 for i in range(G)]  # one whole group: its last answer carries the claim
        return {"appends_per_s": round(n / busy, 1), "noop_calls_per_s": round(n / noop, 1),
                "round_trip_us": round(rtt * 1e6, 1),
                "append_request_bytes": len(request), "append_answer_bytes": len(pickle.dumps(answer)),
                "write_answer_bytes": len(pickle.dumps(group[-1])), "confirm_request_bytes": len(confirm)}
    finally:
        manager.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 s windows (default 8 s)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    seconds = 3.0 if args.quick else 8.0
    writers, shards = (1, 2, 4), (1, 2)
    root = Path(tempfile.mkdtemp(prefix="rbpipe-scale-"))
    try:
        local = bench_local(writers, seconds, root)
        ray_cells, ceiling = bench_ray(writers, shards, seconds, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = {r["writers"]: r["traj_per_s"] for r in local}
    for r in ray_cells:
        r["ratio_to_local"] = round(r["traj_per_s"] / base[r["writers"]], 3) if base[r["writers"]] else None
    report = {"workload": {"payload": PAYLOAD, "grpo_size": G, "seconds": seconds, "store": "arrow"},
              "results": local + ray_cells, "shard_ceiling": ceiling}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{'engine':8} {'W':>3} {'K':>3} {'traj/s':>9} {'ray/local':>9}")
        for r in report["results"]:
            print(f"{r['engine']:8} {r['writers']:>3} {r['shards'] or '-':>3} {r['traj_per_s']:>9} "
                  f"{r.get('ratio_to_local', ''):>9}")
        print("one shard:", json.dumps(ceiling))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
