"""A process's lease on a grouping service, from the worker's side: taken on first use, renewed by a heartbeat,
released when the process leaves (the service's side is :mod:`rbpipe.grouping.leases`).

Why a module of its own: every worker holds one (a writer owns claims with it, a learner or collector shows it
is alive), and its life follows the process, not a transform: fork hooks give a forked child a lease of its own,
exit hooks (atexit and the ``multiprocess(ing)`` children's finalizers) release it, and a transform dropped
without ``close()`` takes its heartbeat with it.

Examples:
    >>> from rbpipe.grouping.manager import start_manager, open_registry
    >>> manager = start_manager()
    >>> lease = ProcessLease(open_registry(manager, "doc", {"grpo_size": 2}))
    >>> token = lease.token_now()
    >>> token.startswith("lease-") and lease.token_now() == token
    True
    >>> lease.release(); manager.shutdown()
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref

from rbpipe.grouping.manager import call

#: Taken while a transform makes its process's lease (one per transform, made on first use).
LEASE_LOCK = threading.Lock()


class ProcessLease:
    """This process's lease on a registry: taken on first use (again after a fork: a child never shares its
    parent's), kept alive by a daemon heartbeat thread, released by :meth:`release` or at exit."""

    def __init__(self, registry) -> None:
        self.registry = registry
        self._reinit()
        _LEASES_HELD.add(self)

    def _reinit(self) -> None:
        self.token: str | None = None
        self.pid: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def token_now(self) -> str:
        """The token to own claims with (a new lease on first use, after a fork, or once the last expired)."""
        pid, token = os.getpid(), self.token
        if self.pid == pid and token is not None:
            return token
        with self._lock:
            if self.pid != pid or self.token is None:
                token = call(self.registry, "lease")
                period = float(call(self.registry, "lease_ttl")) / 3
                self._stop = stop = threading.Event()
                discarded = threading.Event()
                self.token, self.pid = token, pid
                # the thread holds the lease weakly: a transform dropped without close() takes its heartbeat
                # (and its lease, released by the thread on its own connection) with it
                finalizer = weakref.finalize(self, _discard, discarded, stop)
                finalizer.atexit = False
                threading.Thread(target=_beat, args=(weakref.ref(self), self.registry, token, pid, period, stop,
                                                     discarded),
                                 daemon=True, name="rbpipe-lease-heartbeat").start()
            return self.token

    def release(self) -> None:
        """Hand what this process owns on at once (its next call takes a new lease)."""
        with self._lock:
            token, self.token = self.token, None
            self._stop.set()
        if token is not None and self.pid == os.getpid():
            try:
                call(self.registry, "release", token)
            except BaseException:  # noqa: BLE001 - the manager is gone: the lease went with it
                pass


def _discard(discarded: threading.Event, stop: threading.Event) -> None:
    """The lease was garbage-collected (its transform dropped without ``close()``): its heartbeat ends and
    releases it. Only events here: a call to the manager from a finalizer could land in the middle of another
    call on the same connection."""
    discarded.set()
    stop.set()


def _beat(ref: weakref.ReferenceType, registry, token: str, pid: int, period: float, stop: threading.Event,
          discarded: threading.Event) -> None:
    """Renew ``token`` every ``period`` s until released; leave quietly when the manager is gone, the process
    exits, or the lease expired (the next call takes a new one: what it owned may be another's). Holds the lease
    (``ref``) only while it looks at it: once the lease is gone, release ``token`` and end."""
    while not stop.wait(period):
        lease = ref()
        if lease is None:
            break
        if os.getpid() != pid or sys.is_finalizing() or lease.token != token:
            return
        del lease
        try:
            alive = call(registry, "renew", token)
        except BaseException:  # noqa: BLE001 - a dead manager, or an interpreter shutting down
            return
        if not alive:
            lease = ref()
            if lease is not None:
                with lease._lock:
                    if lease.token == token:
                        lease.token = None
            return
    if (discarded.is_set() or ref() is None) and os.getpid() == pid and not sys.is_finalizing():
        try:
            call(registry, "release", token)  # what the dropped transform held goes on at once
        except BaseException:  # noqa: BLE001 - the manager is gone: the lease went with it
            pass


_LEASES_HELD: weakref.WeakSet = weakref.WeakSet()


def _release_leases() -> None:
    """At exit (atexit, or a ``multiprocess(ing)`` child's exit finalizers): release this process's leases, so
    its unwritten claims are handed on at once instead of after their time to live."""
    pid = os.getpid()
    for lease in list(_LEASES_HELD):
        if lease.pid == pid:
            lease.release()


def _forget_leases() -> None:
    """In a forked child: the parent's leases, locks and heartbeats are not the child's."""
    for lease in list(_LEASES_HELD):
        lease._reinit()


def _register_lease_hooks(*_) -> None:
    import multiprocessing.util as std_util

    import multiprocess.util as mp_util

    for util in (std_util, mp_util):  # these children leave by os._exit: atexit does not run there
        util.Finalize(None, _release_leases, exitpriority=20)  # before proxies drop their connections (10)


atexit.register(_release_leases)
_register_lease_hooks()


def _leases_after_fork() -> None:
    _forget_leases()
    _register_lease_hooks()


os.register_at_fork(after_in_child=_leases_after_fork)


def _register_after_multiprocess_fork() -> None:
    import multiprocess.util as mp_util

    mp_util.register_after_fork(_register_lease_hooks, _register_lease_hooks)  # it clears finalizers after fork


_register_after_multiprocess_fork()
