"""Calling a user's reward safely: an exception or a call past the timeout drops that sample, not the run.

Why a thread and not ``signal.alarm``: collectors also run as Ray actors, whose methods need not run on the main
thread, and an alarm would interrupt torch. A batch's rewards run one after another on a daemon thread while the
collector waits with a deadline per call; a call that overruns is abandoned (its thread keeps running, as a
daemon, until the function returns; nothing waits for it at exit) and the batch's remaining calls go on a new
thread. A batch costs one hand-off to the thread, not one per sample.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

REWARD_ERROR = "reward_error"
REWARD_TIMEOUT = "reward_timeout"
REWARD_NOT_A_NUMBER = "reward_not_a_number"


@dataclass(frozen=True)
class Failed:
    """A reward call that gave no usable number: ``reason`` (one of the ``REWARD_*`` names) and a one-line
    ``message``."""

    reason: str
    message: str


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class _Batch:
    """One batch's calls on one thread: results in order, and which call runs since when."""

    def __init__(self, calls: Sequence[Callable[[], Any]], first: int, results: list) -> None:
        self.calls, self.results = calls, results
        self.current, self.started = first, time.monotonic()
        self.cond = threading.Condition()
        self.abandoned = False
        threading.Thread(target=self._run, name="rbpipe-reward", daemon=True).start()

    def _run(self) -> None:
        for i in range(self.current, len(self.calls)):
            with self.cond:
                if self.abandoned:
                    return
                self.current, self.started = i, time.monotonic()
            try:
                value: Any = self.calls[i]()
            except BaseException as err:  # noqa: BLE001 - user code: any failure drops that sample only
                value = Failed(REWARD_ERROR, _one_line(err))
            with self.cond:
                if self.abandoned:
                    return
                self.results[i] = value
                self.current = i + 1
                self.cond.notify_all()


def call_rewards(calls: Sequence[Callable[[], Any]], timeout_s: float) -> list[float | Failed]:
    """Run ``calls`` (each returns a reward) with at most ``timeout_s`` seconds each: a float per call, or a
    :class:`Failed` for one that raised, ran past the timeout or returned no finite number.

    Examples:
        >>> call_rewards([lambda: 1, lambda: 1 / 0], timeout_s=5.0)[1].reason
        'reward_error'
    """
    results: list[Any] = [None] * len(calls)
    i = 0
    while i < len(calls):
        batch = _Batch(calls, i, results)
        with batch.cond:
            while batch.current < len(calls):
                left = batch.started + timeout_s - time.monotonic()
                if left <= 0:
                    batch.abandoned = True
                    results[batch.current] = Failed(REWARD_TIMEOUT, f"the reward ran past --reward-timeout "
                                                                    f"{timeout_s:g} s")
                    break
                batch.cond.wait(left)
            i = batch.current + 1 if batch.abandoned else len(calls)
    return [_number(v) for v in results]


def _number(value: Any) -> float | Failed:
    if isinstance(value, Failed):
        return value
    try:
        x = float(value)
    except (TypeError, ValueError):
        return Failed(REWARD_NOT_A_NUMBER, f"the reward returned {type(value).__name__} {str(value)[:40]!r}, "
                                           "not a number")
    if not math.isfinite(x):
        return Failed(REWARD_NOT_A_NUMBER, f"the reward returned {x}: a non-finite reward would make every "
                                           "advantage of its group NaN")
    return x
