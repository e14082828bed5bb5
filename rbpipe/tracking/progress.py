"""What ``rbpipe run``'s progress line says: the phase the run is in, and figures with one unit per column.

The first seconds of a run (spawning interpreters that import torch, compiling the numba kernels, waiting for
the first whole groups) used to sit at 0% without a word, and the loss (near zero by construction with
group-normalised advantages and one update per batch) read as "training is broken". The line now names the
phase and shows the figures that move: reward, clip fraction, KL and entropy.
"""

from __future__ import annotations

import threading
from typing import Any

STARTING, COMPILING, FIRST_GROUPS, TRAINING, SUMMARY = ("starting processes", "compiling kernels", "first groups",
                                                         "training", "writing the summary")
PHASES = (STARTING, COMPILING, FIRST_GROUPS, TRAINING, SUMMARY)
#: the learner's start-up phase, as it reports it to the service (``Coordinator.report_learner(phase=...)``)
LEARNER_STARTING, LEARNER_COMPILING, LEARNER_READY = 0, 1, 2


def phase(learner_phase: int, step: int, start_step: int) -> str:
    """The phase of a running pipeline, from the learner's published phase and its step counter."""
    if step > start_step:
        return TRAINING
    if learner_phase >= LEARNER_READY:
        return FIRST_GROUPS
    return COMPILING if learner_phase == LEARNER_COMPILING else STARTING


def progress_bar(**kwargs: Any):
    """A ``tqdm`` bar (``kwargs`` are tqdm's) whose write lock is a thread lock only. tqdm's default lock adds a
    ``multiprocessing.RLock``, a named semaphore in /dev/shm that stays there for good when a run is SIGKILLed
    whole (the resource tracker that would unlink it dies with it); rbpipe's bar is written by one process.
    A lock a program set up before (its own bars) is kept."""
    from tqdm import tqdm

    if getattr(tqdm, "_lock", None) is None:
        tqdm.set_lock(threading.RLock())
    return tqdm(**kwargs)


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def postfix(record: dict[str, Any] | None, stats: dict[str, Any], traj_per_s: float) -> dict[str, str]:
    """tqdm postfix fields: the learner's last step (reward, clip fraction, KL, entropy), then the store's
    counts, each column in one unit named in its header (groups or trajectories, never both)."""
    r = record or {}
    return {"reward": _f(r.get("reward_mean"), "{:.2f}"), "clip": _f(r.get("clip_fraction"), "{:.3f}"),
            "kl": _f(r.get("kl_approx"), "{:.2g}"), "entropy": _f(r.get("entropy"), "{:.2f}"),
            "truncated": _f(r.get("truncated_fraction"), "{:.0%}"),
            "busy": _f(r.get("learner/busy_fraction"), "{:.0%}"), "lag": _f(r.get("learner/policy_lag"), "{:.1f}"),
            "groups_written": str(stats.get("written_groups", 0)),
            "groups_dropped": str(stats.get("dropped_groups", 0)),
            "traj_queued": str(stats.get("queued_trajectories", 0)), "traj/s": f"{traj_per_s:.0f}"}
