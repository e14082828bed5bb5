"""The ``multiprocess`` manager that hosts grouping registries, and calls to it that never hang on a corpse.

Workers started by the launcher receive the proxy with their arguments; independently started processes
join with :func:`connect_manager` (address + authkey) and look a registry up by name.
"""

from __future__ import annotations

import os
import pickle
import secrets
import select
import threading
import time
from typing import Any, Protocol

from multiprocess import connection as _mp_connection
from multiprocess import managers as _mp_managers
from multiprocess.managers import BaseManager, MakeProxyType, RemoteError
from multiprocess.reduction import ForkingPickler as _DillPickler

from rbpipe.errors import ConfigError, ManagerDiedError
from rbpipe.grouping.registry import TEMPORARY_STAGING, GroupRegistry, get_registry, join_problem
from rbpipe.system.procs import MAIN_GUARD_HINT, die_with_parent, settle_heap, use_owned_socket_dir, worker_context
from rbpipe.timing import OWNER_POLL_S

_DIED = (EOFError, ConnectionError, BrokenPipeError, OSError)


# -- the wire: stdlib pickle, dill only when needed -----------------------------------------------------------
# ``multiprocess`` connections pickle every message with dill (slow for the small per-trajectory request and
# its answer, on each side); the registry's messages are plain data that the C pickler handles far faster
# (figures: docs/DESIGN.md, Figures behind code choices). Each message is tagged: ``S`` stdlib pickle, ``D`` dill
# (anything stdlib pickle refuses, e.g. a lambda ``candidate_selector``, or that refers to ``__main__``, which dill
# sends by value).
SERIALIZER = "rbpipe-pickle"
_STD, _DILL = b"S", b"D"
_STD_TAG = _STD[0]


def _dumps(obj) -> bytes:
    try:
        data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - anything stdlib pickle cannot do, dill may
        data = None
    if data is None or b"__main__" in data:
        return _DILL + bytes(_DillPickler.dumps(obj))
    return _STD + data


def _loads(buf: memoryview):
    if buf[0] == _STD_TAG:
        return pickle.loads(buf[1:])
    return _DillPickler.loads(buf[1:])


# -- waiting for a message: poll briefly, then sleep ------------------------------------------------------------
# A process that sleeps in ``read()`` until its next message lets its CPU go idle, and on a virtual machine
# waking an idle vCPU is slow (figures: docs/DESIGN.md, "Waiting for the manager"). So a connection polls its
# socket, yielding the CPU between polls so that runnable processes are not held up, for up to
# ``RBPIPE_SPIN_US`` microseconds before it sleeps in ``read()``. In the manager at
# most one connection thread polls at a time: several polling threads only fought over the GIL (writers ran
# slower; figures: docs/DESIGN.md, Figures behind code choices).
def spin_seconds(raw: str | None = None) -> float:
    """The poll-before-sleep window, in seconds, from ``RBPIPE_SPIN_US`` (default 1000 us)."""
    raw = os.environ.get("RBPIPE_SPIN_US", "1000") if raw is None else raw
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also rejects NaN
        raise ConfigError(f"RBPIPE_SPIN_US must be a number of microseconds >= 0 (0 turns polling off), "
                          f"got {raw!r}")
    return value / 1e6


_SERVER_POLL_TOKEN = threading.Lock()  # held by the one manager connection thread that may poll


class _Connection(_mp_connection.Connection):
    """A ``multiprocess`` socket connection whose ``send``/``recv`` use :func:`_dumps`/:func:`_loads`, and
    whose ``recv`` polls for up to ``spin_s`` before it sleeps (see above). ``poll_token``: a lock that a
    connection must hold to poll (the manager's connection threads share one); None: always poll."""

    spin_s = 0.0
    poll_token: threading.Lock | None = None
    _poller = None

    def send(self, obj) -> None:
        self._check_closed()
        self._check_writable()
        self._send_bytes(_dumps(obj))

    def recv(self):
        self._check_closed()
        self._check_readable()
        if self.spin_s:
            self._await_message()
        return _loads(self._recv_bytes().getbuffer())

    def _await_message(self) -> None:
        token = self.poll_token
        if token is not None and not token.acquire(False):
            return
        try:
            if self._poller is None:
                self._poller = select.poll()
                self._poller.register(self._handle, select.POLLIN)
            deadline = time.perf_counter() + self.spin_s
            while not self._poller.poll(0) and time.perf_counter() < deadline:  # a closed peer reads as ready
                os.sched_yield()
        finally:
            if token is not None:
                token.release()


def _wrap(conn, poll_token: threading.Lock | None = None, spin_s: float | None = None):
    if type(conn) is not _mp_connection.Connection:
        return conn
    handle, conn._handle = conn._handle, None  # hand the open socket over (multiprocess has no detach())
    wrapped = _Connection(handle)
    if hasattr(select, "poll"):
        wrapped.spin_s = spin_seconds() if spin_s is None else spin_s
        wrapped.poll_token = poll_token
    return wrapped


class _Listener(_mp_connection.Listener):
    def accept(self):
        try:
            spin_s = spin_seconds()
        except ConfigError:  # the connecting process raises it; the manager must keep accepting
            spin_s = 0.0
        return _wrap(super().accept(), _SERVER_POLL_TOKEN, spin_s)


def _Client(address, family=None, authkey=None):  # noqa: N802 - mirrors multiprocess.connection.Client
    return _wrap(_mp_connection.Client(address, family, authkey))


_mp_managers.listener_client.setdefault(SERIALIZER, (_Listener, _Client))


# Proxy to a GroupRegistry, named in this module so that unpickling it (in any process) imports this module
# and so registers the wire above.
RegistryProxy = MakeProxyType("RegistryProxy", GroupRegistry.exposed)
RegistryProxy.__module__ = __name__


class GroupingManager(BaseManager):
    """Manager process holding :class:`GroupRegistry` objects (its methods run in there)."""

    def __init__(self, address=None, authkey=None, serializer: str = SERIALIZER, ctx=None, **kwargs) -> None:
        super().__init__(address=address, authkey=authkey, serializer=serializer, ctx=ctx, **kwargs)


GroupingManager.register("get_registry", callable=get_registry, proxytype=RegistryProxy,
                         exposed=GroupRegistry.exposed)

# The service registers its coordinator on this manager (rbpipe.service.host): grouping does not know the service.


# -- a forked child never uses its parent's connection -----------------------------------------------------------
# A proxy keeps one connection per manager address and thread; ``multiprocess`` forgets them in children it
# forks itself, but a child of ``os.fork`` (stdlib ``multiprocessing`` "fork", torch, a plain fork) would share
# the parent's socket: answers would go to whichever process reads first, then both hang. The connections are
# forgotten in the child (at fork, and by pid at the next call should a fork have skipped Python's hooks); the
# parent's socket is neither read nor shut down there.
_CONNECTION_PID = os.getpid()


def _forget_connections() -> None:
    global _CONNECTION_PID
    _CONNECTION_PID = os.getpid()
    _mp_managers.BaseProxy._mutex._at_fork_reinit()
    for tls, _ in list(_mp_managers.BaseProxy._address_to_local.values()):
        tls.__dict__.pop("connection", None)


os.register_at_fork(after_in_child=_forget_connections)


# -- the manager process: dies with its owner, leaves nothing behind ------------------------------------------


def _clean_up() -> None:
    import shutil

    from multiprocess import util as mp_util

    for path in list(TEMPORARY_STAGING):
        shutil.rmtree(path, ignore_errors=True)
    TEMPORARY_STAGING.clear()
    tempdir = mp_util.process.current_process()._config.get("tempdir")  # holds the Unix socket
    if tempdir:
        shutil.rmtree(tempdir, ignore_errors=True)


def _init_manager_process(owner: int | None = None) -> None:
    import signal

    import torch
    from multiprocess import util as mp_util

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the workers; the launcher shuts us down
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as does a SIGTERM of the process group (its owner stops us)
    torch.set_num_threads(1)  # decisions are tiny tensor ops: intra-op threads only cost
    # A process inherits its starter's temporary directory setting, and the starter's directory also holds the
    # fork server's socket: the manager makes its own (for its Unix socket), which _clean_up removes, or, after a
    # SIGKILL, the next sweep (rbpipe.system.procs.sweep_orphaned_socket_dirs)
    use_owned_socket_dir(replace=True)
    mp_util.Finalize(None, _clean_up, exitpriority=-1)  # a normal shutdown removes temporary staging too
    if owner is not None:
        # polling only (no PR_SET_PDEATHSIG): a library caller may start the manager from a thread that ends first
        die_with_parent(owner, poll_s=OWNER_POLL_S, deathsig=False, on_exit=_clean_up)
    settle_heap()  # the registries this process serves are small next to the modules it imported


def start_manager(*, address: tuple[str, int] | str | None = None, authkey: bytes | None = None) -> GroupingManager:
    """Start a grouping manager process (forked by the fork server, :func:`rbpipe.system.procs.worker_context`).
    Shut it down with ``manager.shutdown()``.

    ``address=None`` listens on a Unix socket in a private temporary directory where the platform has them
    (less CPU per call than TCP loopback, in the manager and in every writer; figures: docs/DESIGN.md, Figures behind
    code choices); pass ``("127.0.0.1", 0)`` (or a host's address) for a TCP socket that processes may join from
    elsewhere.
    """
    spin_seconds()  # a bad RBPIPE_SPIN_US fails here, in plain words, before a process is spawned
    manager = GroupingManager(address=address, authkey=authkey or secrets.token_bytes(32),
                              ctx=worker_context())  # it ignores Ctrl-C: its owner shuts it down
    try:
        manager.start(_init_manager_process, (os.getpid(),))
    except EOFError:  # it died before it answered: a script without a __main__ guard (procs.MAIN_GUARD_HINT)
        raise ConfigError(f"the grouping manager process ended before it started: {MAIN_GUARD_HINT}") from None
    return manager


def connect_manager(address, authkey: bytes) -> GroupingManager:
    """Join a running grouping manager from an independently started process."""
    manager = GroupingManager(address=tuple(address) if isinstance(address, list) else address, authkey=authkey)
    try:
        manager.connect()
    except _DIED as err:
        raise ManagerDiedError(f"cannot reach the grouping manager at {address}: {err}. Check that the "
                               "launcher is running and that address and authkey are right") from err
    manager.joined = True  # several processes join it: a registry must be named to be shared
    return manager


def manager_address(manager: GroupingManager) -> tuple[Any, bytes]:
    """``(address, authkey)`` to hand to :func:`connect_manager` in another process."""
    return manager.address, bytes(manager._authkey)


def call(proxy, method: str, *args, **kwargs):
    """Call a registry method; a dead manager becomes :class:`ManagerDiedError` (raised at once, no hang)."""
    if _CONNECTION_PID != os.getpid():
        _forget_connections()
    try:
        return proxy._callmethod(method, args, kwargs)
    except RemoteError as err:
        raise ManagerDiedError(f"the grouping manager failed while running {method}: {err}") from err
    except _DIED as err:
        raise ManagerDiedError(
            f"the grouping manager stopped answering ({type(err).__name__}: {err}) in process {os.getpid()}; "
            "shared grouping state is gone. Restart the run (queued trajectories stay staged on disk and "
            "are re-queued from the staging directory when the run is resumed)") from err


class RegistryHost(Protocol):
    """What hosts grouping registries: :class:`GroupingManager`, or the Ray engine's ``RayManager`` (the same
    interface over Ray actors, :mod:`rbpipe.service.ray`)."""

    def get_registry(self, name: str, options: dict | None = None, shards: int = 16,
                     staging: dict | None = None) -> Any: ...


def get_proxy(manager: Any, method: str, *args: Any, died: str = "Is it still running?") -> Any:
    """``manager.<method>(*args)``, a proxy, over a connection of this process's own (not one inherited through
    a fork); a manager that is gone raises :class:`ManagerDiedError` (``died`` says what to check)."""
    if _CONNECTION_PID != os.getpid():
        _forget_connections()
    try:
        return getattr(manager, method)(*args)
    except _DIED as err:
        raise ManagerDiedError(f"cannot reach the grouping manager: {err}. {died}") from err


def open_registry(manager: RegistryHost, name: str, options: dict | None = None, shards: int = 16,
                  staging: dict | None = None):
    """Proxy to the registry ``name`` in ``manager`` (created with ``options`` if new; joining one with other
    options or another staging directory raises :class:`ConfigError`). ``staging``: ``{"path": str,
    "temporary": bool}`` of the opener's staging directory."""
    proxy = get_proxy(manager, "get_registry", name, options, shards, staging)
    problem = join_problem(name, call(proxy, "join_info"), options, staging)
    if problem is not None:
        raise ConfigError(problem)
    return proxy

