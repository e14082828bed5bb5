"""A worker's stop: SIGTERM ends the step in progress (a learner's training step, a collector's generation) at a
point where abandoning it is safe.

A learner step of a real model takes seconds (figures: docs/DESIGN.md, Figures behind code choices); the launcher cannot
wait for every step to end before it stops a run, and a learner killed mid-step leaves no checkpoint of its last
finished step. So SIGTERM only sets a flag, and the step checks it where nothing is half done: before each
module's forward pass and just before the optimizer updates the weights (an optimizer step pre-hook). There the
step is abandoned (:class:`StepAbandoned`): model and optimizer are still those of the last finished step, and
the learner checkpoints them with the sampler as it was before the abandoned draw (its groups are trained after a
resume). Once the optimizer has begun, the step finishes. A collector's generation is abandoned the same way, at
the policy's next forward pass: nothing of it was handed over, and its units go back to the other collectors
when it leaves. A hand-over in progress always finishes (it runs no forward pass). Nothing is raised from the
signal handler itself: an exception in the middle of a round trip to the service or of a file write would leave
either half done.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import torch


class StepAbandoned(BaseException):
    """The worker's step in progress was abandoned for a stop (a ``BaseException``: no ``except Exception`` in
    the model's or torchrl's code may swallow it)."""


class StepStop:
    """SIGTERM of a worker process: ``requested`` from then on; :meth:`check` raises :class:`StepAbandoned`
    inside a step (:meth:`step`) until the optimizer begins its update.

    Args:
        model: the trained (or generating) module; a forward pre-hook on each of its modules checks for a stop.
        optimizer: its optimizer, if it trains; a step pre-hook checks a last time, then the update may no
            longer be abandoned.
        what: what a step is, for the message (``"the learner's step"``, ``"the collector's generation"``).

    Examples:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> stop = StepStop(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> with stop.step():  # no stop asked for: the step runs
        ...     out = model(torch.ones(2))
        >>> stop.request()  # what SIGTERM does
        >>> try:
        ...     with stop.step():
        ...         out = model(torch.ones(2))
        ... except StepAbandoned as err:
        ...     print(err)
        stop requested: the learner's step was abandoned
        >>> stop.close()
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 what: str = "the learner's step") -> None:
        self.what = what
        self.requested = False
        self.signal_name: str | None = None
        self._in_step = False
        self._committing = False
        self._old_handler: Any = None
        self._hooks = [m.register_forward_pre_hook(self._forward_check) for m in model.modules()]
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(self._before_update))

    def install(self) -> StepStop:
        """Take SIGTERM (in the main thread only: a learner in a Ray actor's thread is stopped by the service)."""
        if threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
            self._old_handler = None

    def request(self, name: str = "stop") -> None:
        """Ask for the stop (what SIGTERM does)."""
        self.requested = True
        self.signal_name = self.signal_name or name

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.request(signal.Signals(signum).name)  # raises nothing: see the module's docstring

    def step(self) -> _Step:
        """The span of one step (wait, draw, loss, backward) in which a stop abandons it."""
        return _Step(self)

    def check(self) -> None:
        """Raise :class:`StepAbandoned` if a stop was requested and the step may still be abandoned."""
        if self.requested and self._in_step and not self._committing:
            raise StepAbandoned(f"stop requested: {self.what} was abandoned")

    def sleep(self, seconds: float, slice_s: float = 0.01) -> None:
        """Sleep in slices, abandoning the step as soon as a stop is requested (a slow step's stand-in)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.check()
            time.sleep(min(slice_s, left))
        self.check()

    def _forward_check(self, module: torch.nn.Module, args: Any) -> None:
        self.check()

    def _before_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.check()  # the last point where the weights are still the last finished step's
        self._committing = True


class _Step:
    def __init__(self, stop: StepStop) -> None:
        self.stop = stop

    def __enter__(self) -> StepStop:
        self.stop._in_step, self.stop._committing = True, False
        self.stop.check()
        return self.stop

    def __exit__(self, *exc: Any) -> None:
        self.stop._in_step, self.stop._committing = False, False
