"""Shutting torchrl's ``RayReplayBuffer`` down without leaving anything in ``/dev/shm``.

Why: ``RayReplayBuffer.shutdown()`` (torchrl 0.14.1) is a ``ray.kill`` of the buffer's actor. Killed, the actor's
process never unlinks the named semaphores of its buffer's locks: ``sem.mp-*`` files stay in ``/dev/shm`` for
every buffer (figures: docs/DESIGN.md, Figures behind code choices). A clean exit of the actor first
(``__ray_terminate__``: it finishes the calls it holds, then exits through the interpreter's exit hooks) unlinks them.
Used where rbpipe runs the recipe's own buffer beside its handle: ``bench/torchrl_buffer.py`` and the differential test.
"""

from __future__ import annotations

from typing import Any


def close_ray_replay_buffer(buffer: Any, timeout_s: float = 60.0) -> None:
    """End ``buffer``'s actor by a clean exit, then ``buffer.shutdown()`` (a no-op kill of a finished actor).

    Examples:
        >>> close_ray_replay_buffer(object()) is None  # a buffer without an actor: nothing to end
        True
    """
    actor = getattr(buffer, "_rb", None)
    if actor is None:
        return
    import ray

    try:
        ray.get(actor.__ray_terminate__.remote(), timeout=timeout_s)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        pass  # the actor is gone: the call's answer is its exit
    buffer.shutdown()
