"""Collector process: attach to a service, then generate the work units it hands out and hand them over.

The service's coordinator gives each collector units of a prompt's group (its share of the ``grpo_size``
samples), preferring a different collector for each unit, so the samples of prompt ``i`` come from several
processes and only the shared grouping transform can complete the group. The same loop runs under
``rbpipe run`` (spawned, one per ``--collectors``) and from a shell (``rbpipe collector --connect``).
"""

from __future__ import annotations

import functools
import time
import zlib
from collections import Counter
from pathlib import Path

import torch

from rbpipe.clients import CollectorClient
from rbpipe.demo.policy import sample_batch
from rbpipe.errors import BadTrajectoryError
from rbpipe.memory import PeakMemory
from rbpipe.procs import run_worker, settle_heap
from rbpipe.schema import make_trajectory

#: How long one ask waits for prompts to open while the rate limit holds them back (the service answers as soon
#: as the learner moves the band; the collector checks for a stop request in between).
TAKE_WAIT_S = 0.1


def run_collector(target: str | Path, collector_id: int | None = None, *, task: str | None = None,
                  model: str | None = None, authkey_file: str | None = None, log=print, announce: bool = True) -> None:
    """Generate and hand over work units until the service asks its workers to stop. It tunes its process
    for the loop: one torch thread, and :func:`rbpipe.procs.settle_heap` (garbage collection) once set up."""
    torch.set_num_threads(1)  # one core per process; avoids oversubscription on small machines
    client = CollectorClient(target, authkey_file=authkey_file, collector_id=collector_id, task=task, model=model)
    try:
        cfg = client.config
        # --model PATH or the built-in one, on its device in --dtype; the learner's weights replace its own
        policy = cfg.collector_model()
        version = client.load_weights(policy)
        task_obj = cfg.make_task()  # built here from the spec: prompt(i) is the same in every process
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + client.collector_id * 104_729
                                            + zlib.crc32(client.lease.encode()))  # a restart samples anew
        if announce:
            log(f"[collector {client.collector_id}] attached to {client.run_dir}")
        settle_heap()
        memory = PeakMemory(client.run_dir, f"collector {client.collector_id}")  # summary.json's peak_rss_mb
        while not client.stop_requested():
            # a learner step's worth of prompts at once (one unit of each): generated in one batch and handed
            # over in one call, so a step's groups are ready one generation + one hand-over after the band moves
            units = client.take_many(cfg.groups_per_step, wait_s=TAKE_WAIT_S)
            if not units:
                continue
            if client.weights_version != version:
                version = client.load_weights(policy)
            prompts = [task_obj.prompt(unit["prompt"]) for unit in units]
            started = time.perf_counter_ns()
            samples = sample_batch(policy, prompts, [unit["samples"] for unit in units],
                                   max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, generator=gen)
            client.add_generate_time(time.perf_counter_ns() - started)
            memory.update()
            trajs = [make_trajectory(group_id=unit["prompt"], prompt=prompt, response=response, rollout_log_probs=lp,
                                     reward=float(task_obj.reward(prompt, response)),
                                     collector_id=client.collector_id, policy_version=version)
                     for unit, prompt, (tokens, log_probs) in zip(units, prompts, samples, strict=True)
                     for response, lp in zip(tokens, log_probs, strict=True)]
            try:
                client.extend(trajs)  # every unit in one hand-over
            except BadTrajectoryError as err:  # rejected before touching shared state: counted, not lost
                log(f"[collector {client.collector_id}] rejected: {err}")
                prompt_of = [unit["prompt"] for unit in units for _ in range(unit["samples"])]
                bad = getattr(err, "rejected_indices", None)  # None: none of the call was handed over
                for prompt, n in Counter(prompt_of if bad is None else [prompt_of[i] for i in bad]).items():
                    client.skip(prompt, n)
    finally:
        client.close()


def collector_entry(target: str, collector_id: int) -> None:
    """Process target of ``rbpipe run`` (see :func:`rbpipe.procs.run_worker`)."""
    run_worker(f"collector {collector_id}", functools.partial(run_collector, announce=False), target, collector_id)
