"""Collector process: attach to a service, then generate the work units it hands out and hand them over.

The service's coordinator gives each collector units of a prompt's group (its share of the ``grpo_size``
samples), preferring a different collector for each unit, so the samples of prompt ``i`` come from several
processes and only the shared grouping transform can complete the group. The same loop runs under
``rbpipe run`` (spawned, one per ``--collectors``) and from a shell (``rbpipe collector --connect``).
"""

from __future__ import annotations

import functools
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

import torch

from rbpipe.errors import BadTrajectoryError
from rbpipe.model.limits import max_positions
from rbpipe.model.rollout import Rollouts
from rbpipe.sampling.staleness import units_per_ask
from rbpipe.service.clients import CollectorClient
from rbpipe.system import fault_hooks
from rbpipe.system.procs import run_worker, settle_heap
from rbpipe.system.step_stop import StepAbandoned, StepStop
from rbpipe.timing import TAKE_WAIT_S
from rbpipe.tracking.memory import PeakMemory
from rbpipe.trajectory import FINISH_REASON_KEY


def run_collector(target: str | Path, collector_id: int | None = None, *, task: str | None = None,
                  model: str | None = None, authkey_file: str | None = None, log=print,
                  announce: bool = True) -> str | None:
    """Generate and hand over work units until the service asks its workers to stop, or SIGTERM: that abandons
    a generation in progress at the policy's next forward pass (a real model's round takes seconds, longer than
    the launcher waits) and leaves cleanly; a hand-over in progress finishes first. It tunes its process for the
    loop: one torch thread, and :func:`rbpipe.system.procs.settle_heap` (garbage collection) once set up.
    Returns the signal that stopped it (``"SIGTERM"``), or None when the service asked."""
    torch.set_num_threads(1)  # one core per process; avoids oversubscription on small machines
    client = CollectorClient(target, authkey_file=authkey_file, collector_id=collector_id, task=task, model=model)
    stop: StepStop | None = None
    try:
        cfg = client.config
        # --model PATH or the built-in one, on its device in --dtype (the learner's weights replace its own), with
        # its tokenizer: text prompts go through its chat template, responses stop at its EOS ids and are decoded
        policy, tokenizer = cfg.collector_model_and_tokenizer()
        version = client.load_weights(policy)
        gen = torch.Generator(device=cfg.collectors_device)  # where the model samples
        gen.manual_seed(cfg.seed * 7919 + client.collector_id * 104_729
                        + zlib.crc32(client.lease.encode()))  # a restart samples anew
        rollouts = Rollouts(cfg.make_task(),  # built here from the spec: prompt(i) is the same in every process
                            tokenizer, cfg.sampling(tokenizer, policy), chat_template=cfg.chat_template,
                            max_positions=max_positions(policy), reward_timeout_s=cfg.reward_timeout,
                            task_label=cfg.task_label, generator=gen,
                            log=lambda line: _warn(f"[collector {client.collector_id}] {line}"),
                            record_finish_reason=_store_takes(client.storage, FINISH_REASON_KEY))
        stop = StepStop(policy, what="the collector's generation").install()
        if announce:  # only now: from here on SIGTERM leaves cleanly (before, it interrupts the setup)
            log(f"[collector {client.collector_id}] attached to {client.run_dir}")
        settle_heap()
        memory = PeakMemory(client.run_dir, f"collector {client.collector_id}")  # summary.json's peak_rss_mb
        delay, rounds = fault_hooks.generate_delay(), 0
        while not client.stop_requested() and not stop.requested:
            # a learner step's worth of prompts at once (one unit of each): generated in one batch and handed
            # over in one call, so a step's groups are ready one generation + one hand-over after the band moves
            units = client.take_many(units_per_ask(cfg), wait_s=TAKE_WAIT_S)
            if not units:
                continue
            if client.weights_version != version:
                version = client.load_weights(policy)
            started = time.perf_counter_ns()
            try:
                with stop.step():
                    if delay and rounds:  # a stop test's slow generation (rbpipe.system.fault_hooks)
                        stop.sleep(delay)
                    batch = rollouts.run(policy, units, collector_id=client.collector_id, policy_version=version)
            except StepAbandoned as abandoned:  # nothing of it was handed over; close() gives its units back
                _warn(f"[collector {client.collector_id}] {stop.signal_name}: {abandoned}, its units go back to the "
                      "service")
                break
            rounds += 1
            client.add_generate_time(time.perf_counter_ns() - started)
            memory.update()
            if batch.dropped:  # not handed over: counted as produced and rejected, by reason (conservation)
                client.drop(dict(batch.dropped))
            for prompt, n in batch.given_up.items():
                client.skip(prompt, n)
            trajs = batch.trajectories
            if not trajs:
                continue
            try:
                client.extend(trajs)  # every unit in one hand-over
            except BadTrajectoryError as err:  # rejected before touching shared state: counted, not lost
                log(f"[collector {client.collector_id}] rejected: {err}")
                prompt_of = [int(t.get("group_id")[0]) for t in trajs]
                bad = getattr(err, "rejected_indices", None)  # None: none of the call was handed over
                for prompt, n in Counter(prompt_of if bad is None else [prompt_of[i] for i in bad]).items():
                    client.skip(prompt, n)
    finally:
        if stop is not None:
            stop.close()
        client.close()
    return stop.signal_name if stop is not None else None


def _warn(line: str) -> None:
    """Warnings go to stderr: under ``rbpipe run --json`` stdout carries the summary alone (the workers' fork
    server keeps the terminal's stdout)."""
    print(line, file=sys.stderr, flush=True)


def _store_takes(storage, key) -> bool:
    """Whether trajectories may carry ``key``: a store keeps the keys of its first group, so one written before
    trajectories carried ``finish_reason`` (an older run, resumed) must not get it."""
    schema = getattr(storage, "schema", None)
    key = (key,) if isinstance(key, str) else tuple(key)
    return schema is None or key in schema.by_key


def collector_entry(target: str, collector_id: int) -> None:
    """Process target of ``rbpipe run`` (see :func:`rbpipe.system.procs.run_worker`)."""
    run_worker(f"collector {collector_id}", functools.partial(run_collector, announce=False), target, collector_id)
