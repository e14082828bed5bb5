"""Storage benchmark: torchrl LazyMemmapStorage / LazyTensorStorage vs rbpipe Arrow and Zarr stores.

Same data, same run. Workloads: ``llm_groups`` (groups of 16 trajectories, 100-1000 ragged tokens +
log-probs; padded to the max length for the torchrl storages, untimed) and ``rl_rows`` (classic RL rows:
obs[64], action, reward, done; written in groups of 64 rows). Writes: the median of five passes (three with
``--quick``), each into a fresh store that is deleted after it, passes interleaved across backends so that
each sees the same machine state (page-cache growth made back-to-back passes of one backend drift).
``arrow``/``zarr`` write each llm group as the pipeline hands it over: one TensorDict whose ragged fields
are jagged ``torch.nested`` tensors (the columnar form, as the memmap baseline gets one padded TensorDict);
``-rows`` writes the same groups as torchrl's ``MCAdvantage`` stacks them (a lazy stack of 16 row
tensordicts, which the store walks row by row). Ops: ``write`` (whole groups) and ``sample``
(16 random whole groups for llm_groups, 256 random rows for rl_rows; warm: every row was read once before,
untimed, so the files are in the page cache and mapped; then the median call is reported).
For arrow on rl_rows, ``sample`` is measured after ``compact()`` (and ``sample_uncompacted`` before).
``arrow``/``zarr`` read ragged fields with the default layout (``"nested"``: one jagged tensor per field);
``-padded`` reads the same store with ``ragged_layout="padded"`` (dense zero-padded tensors, as the memmap
baseline returns them) and ``-rows`` with ``ragged_layout="rows"`` (a lazy stack of per-row tensordicts).
Whole groups are copied by ``rbpipe.storage.gather`` on torch's number of threads when numba's parallel
path is available (``parallel_gather`` in the report; ``RBPIPE_PARALLEL_GATHER=0`` measures the numpy path),
as the memmap baseline's gather runs on torch's threads.
Throughput is rows per second. Nothing is asserted: the figures are reported as measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from tensordict import TensorDict, lazy_stack


def llm_groups(n_groups: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ragged, padded = [], []
    for gid in range(n_groups):
        rows = []
        for _ in range(16):
            L = int(torch.randint(100, 1001, (), generator=g))
            rows.append(TensorDict({"group_id": torch.tensor(gid),
                                    "tokens": {"prompt": torch.randint(0, 32000, (64,), generator=g),
                                               "response": torch.randint(0, 32000, (L,), generator=g)},
                                    "log_probs": {"rollout": torch.randn(L, generator=g)},
                                    "next": {"reward": torch.rand(1, generator=g),
                                             "done": torch.ones(1, dtype=torch.bool)},
                                    "policy_version": torch.tensor(1)}, batch_size=[]))
        ragged.append(lazy_stack(rows, 0))
        resp = torch.zeros(16, 1000, dtype=torch.int64)
        lp = torch.zeros(16, 1000)
        for i, r in enumerate(rows):
            L = r["tokens", "response"].shape[0]
            resp[i, :L] = r["tokens", "response"]
            lp[i, :L] = r["log_probs", "rollout"]
        padded.append(TensorDict({"group_id": torch.full((16,), gid),
                                  "tokens": {"prompt": torch.stack([r["tokens", "prompt"] for r in rows]),
                                             "response": resp},
                                  "log_probs": {"rollout": lp},
                                  "length": torch.tensor([r["tokens", "response"].shape[0] for r in rows]),
                                  "next": {"reward": torch.stack([r["next", "reward"] for r in rows]),
                                           "done": torch.ones(16, 1, dtype=torch.bool)},
                                  "policy_version": torch.ones(16, dtype=torch.int64)}, batch_size=[16]))
    return ragged, padded, 16


def rl_rows(n_groups: int, seed: int = 0, rows: int = 64):
    g = torch.Generator().manual_seed(seed)
    data = [TensorDict({"obs": torch.randn(rows, 64, generator=g),
                        "action": torch.randint(0, 6, (rows,), generator=g),
                        "next": {"reward": torch.randn(rows, 1, generator=g),
                                 "done": torch.zeros(rows, 1, dtype=torch.bool)}}, batch_size=[rows])
            for _ in range(n_groups)]
    return data, data, rows


BACKENDS = ("memmap", "tensor", "arrow", "zarr")


def jagged_group(td) -> TensorDict:
    """A lazy stack of rows -> one TensorDict whose ragged fields are jagged ``torch.nested`` tensors: the
    columnar form of the same group (the form the stores return with ``ragged_layout="nested"``)."""
    rows = td.tensordicts
    group = TensorDict(batch_size=[len(rows)])
    for key in rows[0].keys(True, True):
        ts = [r.get(key) for r in rows]
        group.set(key, torch.stack(ts) if len({t.shape for t in ts}) == 1 else
                  torch.nested.nested_tensor_from_jagged(torch.cat(ts), lengths=torch.tensor([len(t) for t in ts])))
    return group


def _timeit(fn, reps):
    """Median seconds per call after one warm-up call (robust to a neighbour stealing the CPU)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


_TEMP_DIRS: list[str] = []  # every store this run made; removed when it ends


def make_storage(backend: str, workload: str, total: int):
    """A fresh, empty storage of ``backend`` in a new temporary directory."""
    from torchrl.data import LazyMemmapStorage, LazyTensorStorage

    from rbpipe.storage import ArrowStorage, ZarrStorage
    tmp = tempfile.mkdtemp(prefix=f"rbpipe-bench-{backend}-")
    _TEMP_DIRS.append(tmp)
    if backend == "memmap":
        return LazyMemmapStorage(total, scratch_dir=tmp)
    if backend == "tensor":
        return LazyTensorStorage(total)
    cls = ArrowStorage if backend == "arrow" else ZarrStorage
    return cls(Path(tmp) / "store",
               ragged_keys=[("tokens", "response"), ("log_probs", "rollout")] if workload == "llm_groups" else ())


def fill(st, groups, gsize: int, start: int = 0) -> None:
    """Write whole groups: ``set`` at the next rows for torchrl storages, ``append_group`` for ours."""
    for k, td in enumerate(groups, start=start):
        if hasattr(st, "append_group"):
            st.append_group(td)
        else:
            st.set(torch.arange(k * gsize, (k + 1) * gsize), td)


def run(quick: bool) -> list[dict]:
    from torchrl._utils import logger as torchrl_logger
    torchrl_logger.setLevel("WARNING")  # torchrl logs storage allocation to stdout; --json owns stdout
    results = []
    sizes = {"llm_groups": 24 if quick else 128, "rl_rows": 100 if quick else 1000}
    reps, write_reps = (10, 3) if quick else (50, 5)
    for workload, make in (("llm_groups", llm_groups), ("rl_rows", rl_rows)):
        ragged, dense, gsize = make(sizes[workload])
        total = gsize * len(ragged)
        gen = torch.Generator().manual_seed(1)
        inputs = {"memmap": dense, "tensor": dense, "arrow": ragged, "zarr": ragged}
        if workload == "llm_groups":  # jagged fields, as the pipeline hands groups over (built untimed)
            jagged = [jagged_group(td) for td in ragged]
            inputs.update({"arrow": jagged, "zarr": jagged, "arrow-rows": ragged, "zarr-rows": ragged})
        stores = {}
        times: dict[str, list[float]] = {b: [] for b in inputs}
        for rep in range(write_reps):  # passes interleaved across backends: each sees the same machine state
            for backend, groups in inputs.items():
                st = make_storage(backend.split("-")[0], workload, total)
                fill(st, groups[:1], gsize)  # allocation / store creation is not timed
                t0 = time.perf_counter()
                fill(st, groups[1:], gsize, start=1)
                times[backend].append(time.perf_counter() - t0)
                if hasattr(st, "close"):
                    st.close()
                if rep < write_reps - 1 or backend not in BACKENDS:  # free its page cache before the next pass
                    del st
                    shutil.rmtree(_TEMP_DIRS.pop(), ignore_errors=True)
                else:
                    stores[backend] = st
        for backend, ts in times.items():
            dt = sorted(ts)[len(ts) // 2]  # the median pass
            results.append({"backend": backend, "workload": workload, "op": "write",
                            "throughput": (total - gsize) / dt, "seconds": dt, "rows": total - gsize})
        for backend in BACKENDS:
            st, groups = stores[backend], inputs[backend]

            # defaults bind this iteration's values (the closures run within the iteration)
            def draw(workload=workload, groups=groups, gen=gen, gsize=gsize, total=total):
                if workload == "llm_groups":
                    gs = torch.randperm(len(groups), generator=gen)[:16]
                    return (gs[:, None] * gsize + torch.arange(gsize)).reshape(-1)
                return torch.randint(0, total, (256,), generator=gen)

            def sample(st=st):
                return st.get(draw())

            def warm(st=st, total=total):  # every row read once, untimed (page cache and mappings)
                for first in range(0, total, 256):
                    st.get(torch.arange(first, min(total, first + 256)))

            warm()

            extra = {}
            if backend == "arrow" and workload == "rl_rows":
                extra["sample_uncompacted_throughput"] = 256 / _timeit(sample, reps)
                t0 = time.perf_counter()
                st.compact()
                extra["compact_seconds"] = time.perf_counter() - t0
                warm()
            n = 256
            dt = _timeit(sample, reps)
            results.append({"backend": backend, "workload": workload, "op": "sample", "throughput": n / dt,
                            "seconds_per_call": dt, "rows": n, **extra})
            if backend in ("arrow", "zarr") and workload == "llm_groups":  # same store, other ragged layouts
                for layout in ("padded", "rows"):
                    other = type(st)(st.path, create=False, ragged_layout=layout)
                    warm(other)  # a new handle: warmed like every other store
                    dt = _timeit(lambda other=other: other.get(draw()), reps)
                    results.append({"backend": f"{backend}-{layout}", "workload": workload, "op": "sample",
                                    "throughput": n / dt, "seconds_per_call": dt, "rows": n})
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (< 60 s)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        results = run(args.quick)
    finally:
        for tmp in _TEMP_DIRS:
            shutil.rmtree(tmp, ignore_errors=True)
    base = {(r["workload"], r["op"]): r["throughput"] for r in results if r["backend"] == "memmap"}
    for r in results:
        r["ratio_vs_memmap"] = r["throughput"] / base[(r["workload"], r["op"])]
    from rbpipe.storage.gather import parallel_available
    parallel = parallel_available()
    if args.json:
        print(json.dumps({"default_backend": "arrow", "parallel_gather": parallel, "results": results}))
        return
    copier = f"on {torch.get_num_threads()} threads (numba)" if parallel else "with numpy (one core)"
    print(f"whole groups copied {copier}; torch threads: {torch.get_num_threads()}")
    print(f"{'workload':<11} {'op':<7} {'backend':<12} {'rows/s':>12} {'x memmap':>9}")
    for r in results:
        line = (f"{r['workload']:<11} {r['op']:<7} {r['backend']:<12} {r['throughput']:>12.0f} "
                f"{r['ratio_vs_memmap']:>9.2f}")
        if "sample_uncompacted_throughput" in r:
            line += (f"   (before compact(): {r['sample_uncompacted_throughput']:.0f} rows/s, "
                     f"{r['sample_uncompacted_throughput'] / base[(r['workload'], 'sample')]:.2f}x)")
        print(line)


if __name__ == "__main__":
    main()
