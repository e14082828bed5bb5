"""Test hooks of the workers, read from the environment: a fault test must fire its fault at a point the run
cannot have passed, whatever the machine's speed, and a stop test needs steps as slow as a real model's.

* ``RBPIPE_TEST_HOLD_AFTER_STEP=N:PATH`` — once step ``N`` is trained, logged and (if due) checkpointed, the
  learner waits until the file ``PATH`` exists (or a stop is requested). A test waits for step ``N`` in
  ``metrics.jsonl``, fires its fault, then creates ``PATH``. A learner that resumes below ``N`` (after a
  kill) holds at ``N`` again until ``PATH`` exists.
* ``RBPIPE_TEST_HOLD_SHARD_RESTART=PATH`` — a Ray grouping shard that Ray restarted waits, before it replays
  its log, until ``PATH`` exists: a test checks what answers while a shard is down, however fast Ray restarts it.
* ``RBPIPE_TEST_STEP_DELAY_S=X`` — every forward pass of the learner's model takes ``X`` seconds longer (a sleep
  that a stop abandons as it would abandon a real forward pass): a learner step costs what a large model's does.
* ``RBPIPE_TEST_GENERATE_DELAY_S=X`` — every generation of a collector after its first takes ``X`` seconds longer
  (slept before it starts, abandoned by a stop likewise): a collector is still generating when the
  launcher's grace ends, while its first hand-over still feeds the learner's first step.

All are off unless set; they only slow or pause a process, never change what it computes. With
``--engine ray`` they are passed to the worker and shard actors.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from rbpipe.errors import ConfigError

HOLD_ENV = "RBPIPE_TEST_HOLD_AFTER_STEP"
DELAY_ENV = "RBPIPE_TEST_STEP_DELAY_S"
GENERATE_DELAY_ENV = "RBPIPE_TEST_GENERATE_DELAY_S"
SHARD_RESTART_ENV = "RBPIPE_TEST_HOLD_SHARD_RESTART"
#: What ``--engine ray`` forwards to its actors (Ray workers do not inherit the driver's environment)
FORWARDED = (HOLD_ENV, DELAY_ENV, GENERATE_DELAY_ENV, SHARD_RESTART_ENV)


def _seconds(name: str) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(f"{name} must be a number of seconds >= 0, got {raw!r}")
    return value


def step_delay() -> float:
    """``RBPIPE_TEST_STEP_DELAY_S`` in seconds (0 when unset)."""
    return _seconds(DELAY_ENV)


def generate_delay() -> float:
    """``RBPIPE_TEST_GENERATE_DELAY_S`` in seconds (0 when unset)."""
    return _seconds(GENERATE_DELAY_ENV)


def hold_after_step() -> tuple[int, Path] | None:
    """``(N, PATH)`` from ``RBPIPE_TEST_HOLD_AFTER_STEP=N:PATH``, or None when unset."""
    raw = os.environ.get(HOLD_ENV, "")
    if not raw:
        return None
    step, _, path = raw.partition(":")
    if not step.strip().isdigit() or not path:
        raise ConfigError(f"{HOLD_ENV} must be STEP:PATH (e.g. 4:/tmp/release), got {raw!r}")
    return int(step), Path(path)


def hold(path: Path, stopping: Callable[[], bool], poll_s: float = 0.05) -> None:
    """Wait until ``path`` exists or ``stopping()``."""
    while not path.exists() and not stopping():
        time.sleep(poll_s)


def hold_shard_restart(restarted: Callable[[], bool]) -> None:
    """In a shard actor's constructor: a restarted shard waits for ``RBPIPE_TEST_HOLD_SHARD_RESTART``'s file.
    ``restarted`` is asked only when the hook is set (Ray answers it in an actor only, not in a driver that
    builds a shard host in process)."""
    path = os.environ.get(SHARD_RESTART_ENV)
    if path and restarted():
        hold(Path(path), lambda: False)


def forwarded_env() -> dict[str, str]:
    """The hooks set in this process, for worker processes that do not inherit its environment."""
    return {k: os.environ[k] for k in FORWARDED if k in os.environ}
