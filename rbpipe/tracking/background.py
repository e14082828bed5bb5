"""Run a process's bookkeeping (metrics lines, logger scalars, checkpoint files) on one thread beside its work.

The learner's loss, backward and optimizer step must not wait for files: writing a step's metrics, its
logger scalars and (every few steps) a fsynced checkpoint took a visible part of each step on 2 cores (figures:
docs/DESIGN.md, Figures behind code choices). Here they run in submission order on one daemon thread while the next step
trains; the thread's file writes and fsyncs release the GIL.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

_STOP = object()


class BackgroundJobs:
    """Jobs run one at a time, in the order submitted, on one thread.

    A job that raises stops the ones after it (their order matters: a checkpoint must not land after a lost
    metrics line it covers); the error is raised again, in the submitting thread, by the next
    :meth:`submit`, :meth:`drain` or :meth:`close`. ``max_pending`` bounds the queue: a writer slower than
    the loop slows the loop down instead of holding every step in memory. (``ThreadPoolExecutor(1)`` also
    runs jobs in order, but goes on after a failure, keeps it in a future nobody waits on, and queues without
    bound.)

    Examples:
        >>> jobs = BackgroundJobs()
        >>> seen = []
        >>> jobs.submit(seen.append, 1); jobs.submit(seen.append, 2)
        >>> jobs.close()
        >>> seen
        [1, 2]
    """

    def __init__(self, name: str = "rbpipe-bookkeeping", *, max_pending: int = 64) -> None:
        self._jobs: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue ``fn(*args, **kwargs)``; its arguments must not change afterwards (see :func:`snapshot`)."""
        self._raise_failure()
        if not self._thread.is_alive():
            raise RuntimeError("BackgroundJobs is closed: submit jobs before close()")
        self._jobs.put((fn, args, kwargs))

    def drain(self) -> None:
        """Wait until every submitted job has run."""
        self._jobs.join()
        self._raise_failure()

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join()
        self._raise_failure()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is _STOP:
                    return
                if self._error is None:  # after a failure the rest are skipped, in order
                    fn, args, kwargs = job
                    fn(*args, **kwargs)
            except BaseException as err:  # noqa: BLE001 - handed to the submitting thread
                self._error = err
            finally:
                self._jobs.task_done()

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def __enter__(self) -> BackgroundJobs:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # already failing: finish what is queued (a checkpoint), and keep the first error
            try:
                self.close()
            except BaseException:  # noqa: BLE001
                pass


def snapshot(state: Any) -> Any:
    """A copy of nested dicts/lists/tuples whose tensors are cloned: what a background job may save while the
    caller's model and optimizer go on updating in place."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v) for v in state)
    return state
