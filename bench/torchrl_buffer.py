"""Trajectories per second into torchrl's GRPO buffer from W writer processes: ``rbpipe.replay_buffer`` vs
torchrl's ``RayReplayBuffer(storage=LazyStackStorage, transform_factory=partial(MCAdvantage, ...))``.

Same workload for both: W writers each hand over trajectories in torchrl's LLM layout (``Text``/``Tokens``/
``LogProbs``/``Masks``/``ChatHistory``, ragged tokens, a string ``"query"``; what ``LLMCollector`` writes) in
chunks of ``--chunk`` steps (the collector's ``dialog_turns_per_batch``); every group has members from every
writer. Writers are processes started with spawn (rbpipe) or Ray tasks (torchrl's buffer, as the recipe's
collectors are Ray actors). The clock runs from the first writer's start to the last one's end, after each
writer's untimed warm-up chunk. Speed is printed, never asserted. Ray is kept on loopback
(``rbpipe.service.ray.session.use_loopback``); without Ray installed the baseline is torchrl's in-process
``ReplayBuffer`` with the same storage and transform (one writer: the caller).

  python bench/torchrl_buffer.py [--quick] [--json] [--writers 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tensordict import TensorDict, lazy_stack, set_list_to_stack  # noqa: E402
from torchrl._utils import logger as _torchrl_logger  # noqa: E402

_torchrl_logger.setLevel("WARNING")  # --json owns stdout

GRPO_SIZE = 4


def llm_steps(n: int, writer: int, writers: int, prompt_tokens: int, seed: int):
    """``n`` steps; step i of every writer answers prompt i // (GRPO_SIZE // writers or 1) (groups span writers)."""
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies.common import ChatHistory, LogProbs, Masks, Text, Tokens

    g = torch.Generator().manual_seed(seed)
    per_writer = max(GRPO_SIZE // writers, 1)
    steps = []
    for i in range(n):
        query = f"question {i // per_writer} of {seed // 1000}"
        n_resp = int(torch.randint(16, 64, (), generator=g))
        full = torch.randint(3, 30000, (prompt_tokens + n_resp,), generator=g)
        response = "x" * n_resp
        chat = [{"role": "user", "content": query}]
        step = TensorDict({
            "tokens": Tokens(prompt=full[:prompt_tokens], response=full[prompt_tokens:], full=full),
            "log_probs": LogProbs(response=-torch.rand(n_resp, generator=g)),
            "masks": Masks(all_attention_mask=torch.ones(full.shape[0], dtype=torch.bool)),
            "text": Text(prompt=query, response=response, full=query + response),
            "history": ChatHistory(prompt=History.from_chats(chat),
                                   full=History.from_chats([*chat, {"role": "assistant", "content": response}])),
            "done": torch.ones(1, dtype=torch.bool),
            "next": TensorDict({"reward": torch.rand(1, 1, generator=g), "done": torch.ones(1, dtype=torch.bool)}),
        })
        step.set_non_tensor("query", query)
        steps.append(step)
    return lazy_stack(steps)


def _write(rb, writer: int, writers: int, n: int, chunk: int, prompt_tokens: int, run: int) -> tuple[float, float]:
    """One writer: an untimed warm-up chunk, then ``n`` steps; returns its ``(start, end)`` clock."""
    set_list_to_stack(True).set()
    torch.set_num_threads(1)
    warm = llm_steps(chunk, writer, writers, prompt_tokens, seed=run * 1000 + 500 + writer)
    data = llm_steps(n, writer, writers, prompt_tokens, seed=run * 1000 + writer)
    rb.extend(warm)
    start = time.time()
    for i in range(0, n, chunk):
        rb.extend(data[i:i + chunk])
    return start, time.time()


def bench_rbpipe(writers: int, n: int, chunk: int, prompt_tokens: int, run: int) -> dict:
    import rbpipe

    root = Path(tempfile.mkdtemp(prefix="rbpipe-bench-torchrl-"))
    rb = rbpipe.replay_buffer(root / "store", grpo_size=GRPO_SIZE, batch_size=GRPO_SIZE)
    try:
        with multiprocessing.get_context("spawn").Pool(writers) as pool:
            clocks = pool.starmap(_write, [(rb, w, writers, n, chunk, prompt_tokens, run) for w in range(writers)])
        rows = len(rb)
    finally:
        rb.close()
        shutil.rmtree(root, ignore_errors=True)
    return _result("rbpipe.replay_buffer", writers, n, clocks, rows)


def bench_ray(writers: int, n: int, chunk: int, prompt_tokens: int, run: int) -> dict:
    import ray
    from torchrl.data import LazyStackStorage
    from torchrl.data.replay_buffers.ray_buffer import RayReplayBuffer
    from torchrl.objectives.llm import MCAdvantage

    from rbpipe.torchrl_compat.ray_buffer import close_ray_replay_buffer

    rb = RayReplayBuffer(storage=partial(LazyStackStorage, (writers * (n + chunk)) * 2),
                         transform_factory=partial(MCAdvantage, grpo_size=GRPO_SIZE), batch_size=GRPO_SIZE)
    task = ray.remote(num_cpus=0)(_write)
    # torchrl 0.14.1: the buffer itself does not pickle into a task (its ReplayBuffer.__getstate__ reads a
    # `_futures_lock` RayReplayBuffer never sets); its client() is the picklable writer handle
    clocks = ray.get([task.remote(rb.client(), w, writers, n, chunk, prompt_tokens, run) for w in range(writers)])
    rows = len(rb)
    close_ray_replay_buffer(rb)  # not rb.shutdown(): a killed actor leaves its semaphores in /dev/shm
    return _result("RayReplayBuffer", writers, n, clocks, rows)


def bench_local(writers: int, n: int, chunk: int, prompt_tokens: int, run: int) -> dict:
    """No Ray: torchrl's in-process buffer (the one RayReplayBuffer runs in its actor), one writer."""
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm import MCAdvantage

    rb = ReplayBuffer(storage=LazyStackStorage(2 * (n + chunk)), transform=MCAdvantage(grpo_size=GRPO_SIZE),
                      batch_size=GRPO_SIZE)
    clocks = [_write(rb, 0, 1, n, chunk, prompt_tokens, run)]
    return _result("torchrl ReplayBuffer (in-process)", 1, n, clocks, len(rb))


def _result(impl: str, writers: int, n: int, clocks: list, rows: int) -> dict:
    elapsed = max(end for _, end in clocks) - min(start for start, _ in clocks)
    return {"impl": impl, "writers": writers, "trajectories": writers * n, "seconds": round(elapsed, 3),
            "trajectories_per_s": round(writers * n / elapsed, 1), "rows_stored": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few trajectories per writer (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the report) and nothing else")
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--chunk", type=int, default=8, help="steps per extend() (dialog_turns_per_batch)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    args = parser.parse_args()
    n = 64 if args.quick else 512
    n -= n % args.chunk
    try:
        import ray  # noqa: F401

        from rbpipe.service.ray.session import init_ray, use_loopback

        use_loopback()  # a private Ray instance on 127.0.0.1 only (docs/RAY.md)
        init_ray(include_dashboard=False, num_cpus=max(args.writers) + 1, log_to_driver=False,
                 configure_logging=False)
        baseline = bench_ray
    except ImportError:
        baseline = bench_local
    results = []
    for run, writers in enumerate(args.writers):
        for impl in (baseline, bench_rbpipe):
            if impl is bench_local and writers > 1:
                continue
            results.append(impl(writers, n, args.chunk, args.prompt_tokens, run))
    if baseline is bench_ray:
        import ray

        ray.shutdown()
    by = {(r["impl"], r["writers"]): r["trajectories_per_s"] for r in results}
    ratios = {str(w): round(by[("rbpipe.replay_buffer", w)] / by[(results[0]["impl"], w)], 2)
              for w in args.writers if (results[0]["impl"], w) in by}
    report = {"bench": "torchrl_buffer", "quick": args.quick, "chunk": args.chunk, "grpo_size": GRPO_SIZE,
              "prompt_tokens": args.prompt_tokens, "baseline": results[0]["impl"], "results": results,
              "ratio_rbpipe_over_baseline": ratios, "note": "shared machine: indicative only"}
    if args.json:
        print(json.dumps(report))
        return
    for r in results:
        print(f"{r['impl']:>34}  W={r['writers']}  {r['trajectories_per_s']:>8.1f} traj/s  "
              f"({r['trajectories']} in {r['seconds']} s, {r['rows_stored']} rows stored)")
    print("ratio rbpipe/baseline by writers:", ratios)


if __name__ == "__main__":
    main()
