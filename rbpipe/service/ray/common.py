"""What every part of the Ray engine shares: the actors' names, Ray imported lazily, Ray's errors as the
``multiprocess`` manager's clients see them, and the ``multiprocess``-style proxy."""

from __future__ import annotations

from rbpipe.errors import ManagerDiedError

COORDINATOR_NAME = "rbpipe-coordinator"
SHARD_PREFIX = "rbpipe-shard-"
#: Threads of the coordinator actor (Ray's ``max_concurrency``). Each collector holds at most one ask open
#: (``take_many`` waits up to ``MAX_TAKE_WAIT_S`` for the band to move), so this many collectors wait at once
#: before a call queues, for that long at most; the coordinator's state is locked as in the local manager,
#: which serves each connection on a thread of its own.
COORDINATOR_THREADS = 64


def _ray():
    import ray

    return ray


def _get(refs, what: str = "grouping"):
    """``ray.get`` with the errors a client of the ``multiprocess`` manager would see: a dead actor becomes
    :class:`ManagerDiedError`; an exception raised by the method is raised as itself."""
    ray = _ray()
    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as err:
        raise ManagerDiedError(f"the {what} actor stopped answering ({type(err).__name__}); shared grouping "
                               "state is gone. Restart the run (queued trajectories stay staged on disk)") from err
    except ray.exceptions.RayTaskError as err:
        raise err.as_instanceof_cause() from None


class _Proxy:
    def __getattr__(self, method: str):
        if method.startswith("_") or method not in self._exposed():
            raise AttributeError(method)
        return lambda *args, **kwargs: self._callmethod(method, args, kwargs)


