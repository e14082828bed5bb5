"""Collector process: sample this collector's share of every prompt's group and hand it to the buffer.

Every collector walks the same prompt sequence, so the ``grpo_size`` samples of prompt ``i`` come from
several processes and only the shared grouping transform can complete the group.
"""

from __future__ import annotations

import time

import torch

from rbpipe.config import RunConfig
from rbpipe.errors import BadTrajectoryError
from rbpipe.policy import sample_responses
from rbpipe.procs import run_worker
from rbpipe.rate_limit import RateLimiter
from rbpipe.schema import make_trajectory
from rbpipe.weights import SharedWeights
from workers.control import RunCounters


def run_collector(collector_id: int, cfg: RunConfig, buffer, weights: SharedWeights,
                  counters: RunCounters, stop_event, limiter: RateLimiter) -> None:
    torch.set_num_threads(1)  # one core per process; avoids oversubscription on small machines
    model = cfg.make_model()  # --model PATH or the built-in one; the learner's weights replace its own
    version = weights.load_into(model)
    task = cfg.make_task()  # built here from the spec: prompt(i) is the same in every process
    share = cfg.share_of(collector_id)
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + collector_id * 104_729 + counters.prompt_cursor(collector_id))
    index = counters.prompt_cursor(collector_id)
    limiter.set_inserted(collector_id, index)
    while not stop_event.is_set():
        if share == 0:
            time.sleep(0.1)
            continue
        # flow control: the shared rate limiter keeps this collector within its lead over the learner
        if not limiter.wait_insert(1, collector_id, stop_event=stop_event):
            break
        if weights.version != version:
            version = weights.load_into(model)
        prompt = task.prompt(index)
        tokens, log_probs = sample_responses(model, prompt, share, max_new_tokens=cfg.max_new_tokens,
                                             temperature=cfg.temperature, generator=gen)
        for response, lp in zip(tokens, log_probs):
            traj = make_trajectory(group_id=index, prompt=prompt, response=response, rollout_log_probs=lp,
                                   reward=float(task.reward(prompt, response)), collector_id=collector_id,
                                   policy_version=version)
            counters.add_produced(collector_id)
            try:
                buffer.extend(traj)
            except BadTrajectoryError as err:  # rejected before touching shared state: counted, not lost
                counters.add_rejected(collector_id)
                print(f"[collector {collector_id}] rejected a trajectory: {err}", flush=True)
        index += 1
        counters.set_prompt_cursor(collector_id, index)
        limiter.set_inserted(collector_id, index)


def _close_storage(buffer) -> None:
    """Flush this process's catalogue rows and seal its segment (a killed process skips this: the launcher
    repairs the catalogue from the commit log)."""
    try:
        buffer._storage.close()
    except Exception as err:  # noqa: BLE001 - never mask the real exit reason
        print(f"[collector] closing the store failed: {err}", flush=True)


def collector_entry(*args) -> None:
    """Process target (see :func:`rbpipe.procs.run_worker`); the store is closed however the run ends."""
    run_worker(f"collector {args[0]}", run_collector, *args, cleanup=lambda: _close_storage(args[2]))