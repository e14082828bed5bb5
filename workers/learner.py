"""Learner process: sample whole fresh groups from the store, run the GRPO loss, publish new weights.

It reads the store (not the collectors): whatever was committed is trainable, in commit order, once.
"""

from __future__ import annotations

import copy
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchrl.data import ReplayBuffer
from torchrl.data.replay_buffers.writers import ImmutableDatasetWriter

from rbpipe.demo.policy import build_learner_actor
from rbpipe.loss import build_loss_batch, one_update_loss, train_step
from rbpipe.loss.batch import auto_micro_batches, row_sums
from rbpipe.model.device import autocast
from rbpipe.model.truncation import truncated_fraction, warn_truncated
from rbpipe.rundir import METRICS
from rbpipe.sampling import FreshGroupSampler
from rbpipe.service.clients import LearnerClient
from rbpipe.storage import collate_identity
from rbpipe.system import fault_hooks
from rbpipe.system.procs import run_worker, settle_heap
from rbpipe.system.step_stop import StepAbandoned, StepStop
from rbpipe.timing import WAIT_POLL_S
from rbpipe.tracking.background import BackgroundJobs, snapshot
from rbpipe.tracking.checkpoint import load_checkpoint, save_checkpoint
from rbpipe.tracking.memory import PeakMemory
from rbpipe.tracking.metrics_log import MetricsSink, truncate_metrics
from rbpipe.tracking.progress import LEARNER_COMPILING, LEARNER_READY
from rbpipe.trajectory import GROUP_KEY, PROMPT_TOKENS_KEY, RESPONSE_TOKENS_KEY, REWARD_KEY, VERSION_KEY

#: weights + Adam states above this are checkpointed without a background copy (the copy doubles their memory)
SNAPSHOT_LIMIT_BYTES = 256e6


def run_learner(target: str | Path, *, authkey_file: str | None = None, model: str | None = None,
                task: str | None = None, log=print, announce: bool = True, restarted: bool = False) -> str | None:
    """Attach to the service at ``target`` as its learner and train until its ``steps`` (or target reward).

    ``restarted``: this process replaces a learner that died (a learner actor restarted by Ray): it waits for
    the dead one's lease to expire instead of being refused the learner role, then resumes from the checkpoint.

    It tunes its process for the loop: one torch thread, and :func:`rbpipe.system.procs.settle_heap` (garbage
    collection) once set up. Returns the signal that stopped it (``"SIGTERM"``), or None."""
    torch.set_num_threads(1)
    client = LearnerClient(target, authkey_file=authkey_file, model=model, task=task, wait_for_role=restarted)
    attached = f"[learner] {'restarted: re-attached' if restarted else 'attached'} to {client.run_dir}"
    try:
        return _train(client, (lambda: log(attached)) if announce or restarted else (lambda: None))
    finally:
        client.close()


def warn(line: str) -> None:
    """To stderr: under ``rbpipe run --json`` stdout carries the summary alone."""
    print(f"[learner] {line}", file=sys.stderr, flush=True)


def _train(client: LearnerClient, announce: Callable[[], None]) -> str | None:
    """The learner's loop; ``announce()`` once SIGTERM abandons a step cleanly (before that it interrupts the
    setup), so that whoever waits for the "attached" line may stop it cleanly from then on."""
    cfg, run_dir, storage, limiter = client.config, client.run_dir, client.storage, client.limiter
    # --model PATH or the built-in one, on --device with float32 master weights (the forward autocasts to --dtype)
    model, tokenizer = cfg.learner_model_and_tokenizer()
    actor = build_learner_actor(model, tokenizer)
    loss_cfg = cfg.loss_config()
    ref_actor = None
    if loss_cfg.kl_coef:
        ref_model = copy.deepcopy(model).requires_grad_(False)
        ref_actor = build_learner_actor(ref_model, tokenizer)
    loss_module = one_update_loss(actor, loss_cfg, ref_actor=ref_actor)
    recompute_old = not loss_module.old_from_current  # the loss mask needs lp_old before the step
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sampler = FreshGroupSampler(num_groups=cfg.groups_per_step, max_staleness=cfg.max_policy_lag,
                                order=cfg.sample_order)
    # read-only: the learner never writes through this buffer (and torchrl's default writer would hold a
    # multiprocessing.Value, a named semaphore that leaks in /dev/shm when a Ray actor is killed)
    buffer = ReplayBuffer(storage=storage, sampler=sampler, writer=ImmutableDatasetWriter(),
                          batch_size=cfg.groups_per_step * cfg.grpo_size, collate_fn=collate_identity)
    step = 0
    state = load_checkpoint(run_dir)
    if state is not None:  # resume: weights, optimizer, step, policy version, sampler position
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        step = int(state["step"])
        if ref_actor is not None and "ref_model" in state:
            ref_actor.model.load_state_dict(state["ref_model"])
        truncate_metrics(run_dir / METRICS, step)  # steps past it are trained again (a restarted learner's too)
    sampler.consumer_version = step
    client.publish(model, step)
    # the consumed groups are what the rate limit (the collectors' flow control) reads
    client.report(step=step, start_step=step, phase=LEARNER_COMPILING, done=0, **_progress(sampler))
    settle_heap()  # no kernels to compile: with one torch thread the learner reads groups with numpy
    client.report(phase=LEARNER_READY)
    memory = PeakMemory(run_dir, "learner")  # summary.json's peak_rss_mb
    t0 = time.time()
    recent: list[float] = []
    saved = step
    warned = False

    def checkpoint() -> None:  # written beside the next steps (a copy: training goes on updating in place)
        nonlocal saved
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sampler": sampler.state_dict(),
                 "step": step, **({"ref_model": ref_actor.model.state_dict()} if ref_actor else {})}
        if large_state:  # a copy of weights and Adam states would add their size to the learner's peak: save here
            jobs.drain()  # after the lines and checkpoints already queued
            save_checkpoint(run_dir, state)
        else:
            jobs.submit(save_checkpoint, run_dir, snapshot(state))
        saved = step

    # a real model's weights and Adam states (12 bytes a parameter) are large to copy (figures: docs/DESIGN.md, Figures
    # behind code choices)
    large_state = sum(p.numel() for p in model.parameters()) * 12 > SNAPSHOT_LIMIT_BYTES

    last_end = time.perf_counter()  # learner-busy fraction: loss, backward and optimizer over wall time
    # SIGTERM abandons the step in progress where that is safe (rbpipe.system.step_stop); a stop the service asks for
    # (Ctrl-C of `rbpipe run`) lets it finish
    stop = StepStop(model, optimizer).install()
    announce()
    delay, held = fault_hooks.step_delay(), fault_hooks.hold_after_step()
    if delay:
        model.register_forward_pre_hook(lambda module, args: stop.sleep(delay))
    stopping = _Stopping(client, stop)
    before_draw, abandoned = sampler.state_dict(), False
    # the sink closes after the jobs that write to it: files, in step order, then the checkpoint after them
    with MetricsSink(run_dir, cfg.logger, start_step=step) as sink, BackgroundJobs() as jobs:
        reports = _Reports(client, sampler, sink, jobs.submit)
        try:
            while step < cfg.steps and not stop.requested and not client.stop_requested():
                before_draw = sampler.state_dict()
                with stop.step():
                    waited_from = time.perf_counter()
                    # stale groups retired while waiting are published at once: they free the collectors
                    if not limiter.wait_sample(cfg.groups_per_step, lambda: sampler.available_groups(storage),
                                               stop_event=stopping, on_wait=reports.retired_while_waiting,
                                               poll_s=WAIT_POLL_S):
                        break
                    sample_from = time.perf_counter()
                    data_wait = sample_from - waited_from
                    rows, info = buffer.sample(return_info=True)
                    busy_start = time.perf_counter()
                    with autocast(cfg.device, cfg.dtype):
                        batch = build_loss_batch(rows, actor=actor, ref_actor=ref_actor, recompute_old=recompute_old,
                                                 device=cfg.device)
                    # activations within the weights' memory
                    micro_batches = auto_micro_batches(model, batch, cfg.micro_batches)
                    metrics = train_step(loss_module, optimizer, batch, micro_batches=micro_batches,
                                         autocast=functools.partial(autocast, cfg.device, cfg.dtype))
                trained_at = time.perf_counter()
                lag = step - rows.get(VERSION_KEY).double()  # versions between the sampling policy and this update
                step += 1
                sampler.consumer_version = step
                client.publish(model, step)
                now = time.perf_counter()
                busy_fraction = (trained_at - busy_start) / max(now - last_end, 1e-9)
                last_end = now
                reward = rows.get(REWARD_KEY).float()
                truncated = truncated_fraction(rows)
                warned = warn_truncated(truncated, cfg.max_new_tokens, warned, warn)
                record: dict[str, Any]
                record = {"step": step, "time_s": round(time.time() - t0, 4),
                          "reward_mean": float(reward.mean()),
                          **({} if truncated is None else {"truncated_fraction": truncated}),  # text tasks
                          "groups": int(info["group_seq"].numel()),
                          "groups_consumed": sampler.consumed_groups, "trained_groups": None,  # None: see _Reports
                          "stale_groups": sampler.stale_groups,
                          "learner/micro_batches": micro_batches,
                          "learner/busy_fraction": busy_fraction, "learner/policy_lag": float(lag.mean()),
                          "learner/policy_lag_max": float(lag.max()),
                          "learner/data_wait_s": data_wait,  # this step's wait for enough fresh groups
                          "learner/train_s": trained_at - busy_start,  # loss batch, loss, backward, optimizer
                          "learner/sample_s": busy_start - sample_from,  # reading the drawn groups from the store
                          "learner/publish_s": now - trained_at,  # the new weights, to the collectors
                          # collectors' seconds since the last step (all collectors together): blocked on the rate
                          # limit, generating, handing trajectories over to the shared buffer
                          "learner/collectors_rate_limited_s": None, "collectors/generate_s": None,
                          "collectors/handover_s": None,
                          **{k: v for k, v in metrics.items() if k not in ("reward_mean",)}}
                reports.step_done(record, rows)
                memory.update()
                recent = (recent + [record["reward_mean"]])[-10:]
                reached = (cfg.target_reward is not None and len(recent) == 10
                           and sum(recent) / 10 >= cfg.target_reward)
                if step % cfg.checkpoint_every == 0 or step == cfg.steps or reached:
                    checkpoint()
                if reached:
                    break
                if held is not None and step == held[0]:  # a fault test's fixed point (rbpipe.system.fault_hooks)
                    jobs.drain()  # its metrics line and checkpoint are on disk
                    fault_hooks.hold(held[1], stopping.is_set)
        except StepAbandoned:  # SIGTERM: model and optimizer are the last finished step's; its groups go back
            sampler.load_state_dict(before_draw)
            abandoned = True
        if step != saved or abandoned:  # stopped (Ctrl-C, SIGTERM): a resume continues from this very step
            checkpoint()
    memory.update()
    # every metrics line and the last checkpoint are on disk; until then a SIGTERM (a second Ctrl-C of the
    # launcher) only set the flag: the default action would have killed this process in the middle of the write
    client.report(done=1)
    stop.close()
    return stop.signal_name


class _Stopping:
    """Stop asked by the service (:meth:`LearnerClient.is_set`, which asks at most every 0.2 s) or by SIGTERM of
    this process: what the waits of a step take as their ``stop_event``."""

    def __init__(self, client: LearnerClient, stop: StepStop) -> None:
        self.client, self.stop = client, stop

    def is_set(self) -> bool:
        return self.stop.requested or self.client.is_set()


def _progress(sampler: FreshGroupSampler) -> dict[str, int]:
    return {"consumed_groups": sampler.consumed_groups, "stale_groups": sampler.stale_groups,
            "stale_trajectories": sampler.stale_trajectories}


class _Reports:
    """What follows a learner step, sent through ``run`` (the bookkeeping thread's ``submit``) so that the next
    step trains meanwhile: the progress report to the service (a round trip; it returns the
    collectors' timing), the group fingerprints and the metrics line (figures: docs/DESIGN.md, Figures behind code
    choices). ``run`` keeps their order.

    While the learner waits for groups it reports only when groups were retired as stale (they free the
    collectors' band), not at every check."""

    def __init__(self, client: LearnerClient, sampler: FreshGroupSampler, sink: MetricsSink | None,
                 run: Callable[..., None]) -> None:
        self.client, self.sampler, self.sink, self.run = client, sampler, sink, run
        self.collectors_mark = client.collectors_timing()
        self.published = sampler.stale_groups

    def retired_while_waiting(self) -> None:
        if self.sampler.stale_groups != self.published:
            self.published = self.sampler.stale_groups
            self.run(self.client.report, **_progress(self.sampler))

    def step_done(self, record: dict[str, Any], rows) -> None:
        """``record``'s ``None`` fields are filled in on the thread, in place (the keys keep their order)."""
        self.published = self.sampler.stale_groups
        self.run(self._finish, record, rows, {**_progress(self.sampler), "step": record["step"]})

    def _finish(self, record: dict[str, Any], rows, progress: dict[str, int]) -> None:
        now = self.client.report(**progress)
        spent = {k: now[k] - self.collectors_mark[k] for k in now}
        self.collectors_mark = now
        record.update({"learner/collectors_rate_limited_s": spent["rate_limited_s"],
                       "collectors/generate_s": spent["generate_s"], "collectors/handover_s": spent["handover_s"],
                       "trained_groups": _group_fingerprints(rows)})
        if self.sink is not None:
            self.sink.log(record)


def _group_fingerprints(rows) -> list[list[int]]:
    """``[group_id, members, token checksum]`` per sampled group, in the order drawn: lets tests check the
    learner read exactly the rows the collectors wrote."""
    gids = rows.get(GROUP_KEY).reshape(len(rows), -1)[:, 0].numpy()
    sums = (row_sums(rows, PROMPT_TOKENS_KEY) + 3 * row_sums(rows, RESPONSE_TOKENS_KEY)).numpy()
    groups, first, which, members = np.unique(gids, return_index=True, return_inverse=True, return_counts=True)
    checksums = np.zeros(len(groups), np.int64)
    np.add.at(checksums, which, sums)
    return np.stack([groups.astype(np.int64), members, checksums], 1)[np.argsort(first)].tolist()


def learner_entry(target: str) -> None:
    """Process target of ``rbpipe run`` (see :func:`rbpipe.system.procs.run_worker`)."""
    run_worker("learner", functools.partial(run_learner, announce=False), target)
