"""The ``multiprocess`` manager that hosts grouping registries, and calls to it that never hang on a corpse.

Workers started by the launcher receive the proxy with their arguments; independently started processes
join with :func:`connect_manager` (address + authkey) and look a registry up by name.
"""

from __future__ import annotations

import os
import pickle
import secrets
from typing import Any

import multiprocess
from multiprocess import connection as _mp_connection
from multiprocess import managers as _mp_managers
from multiprocess.managers import BaseManager, MakeProxyType, RemoteError
from multiprocess.reduction import ForkingPickler as _DillPickler

from rbpipe.errors import ManagerDiedError
from rbpipe.grouping.registry import GroupRegistry, get_registry

_DIED = (EOFError, ConnectionError, BrokenPipeError, OSError)


# -- the wire: stdlib pickle, dill only when needed -----------------------------------------------------------
# ``multiprocess`` connections pickle every message with dill (~15 us for the small per-trajectory request and
# as much for its answer, on each side); the registry's messages are plain data that the C pickler handles in
# well under a microsecond. Each message is tagged: ``S`` stdlib pickle, ``D`` dill (anything stdlib pickle
# refuses, e.g. a lambda ``candidate_selector``, or that refers to ``__main__``, which dill sends by value).
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


class _Connection(_mp_connection.Connection):
    """A ``multiprocess`` socket connection whose ``send``/``recv`` use :func:`_dumps`/:func:`_loads`."""

    def send(self, obj) -> None:
        self._check_closed()
        self._check_writable()
        self._send_bytes(_dumps(obj))

    def recv(self):
        self._check_closed()
        self._check_readable()
        return _loads(self._recv_bytes().getbuffer())


def _wrap(conn):
    if type(conn) is not _mp_connection.Connection:
        return conn
    handle, conn._handle = conn._handle, None  # hand the open socket over (multiprocess has no detach())
    return _Connection(handle)


class _Listener(_mp_connection.Listener):
    def accept(self):
        return _wrap(super().accept())


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


def _init_manager_process() -> None:
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the workers; the launcher shuts us down
    torch.set_num_threads(1)  # decisions are tiny tensor ops: intra-op threads only cost (~25% per call)


def start_manager(*, address: tuple[str, int] | str | None = None, authkey: bytes | None = None) -> GroupingManager:
    """Start a grouping manager process (``multiprocess`` spawn). Shut it down with ``manager.shutdown()``.

    ``address=None`` listens on a Unix socket in a private temporary directory where the platform has them
    (about 20% less CPU per call than TCP loopback, in the manager and in every writer); pass
    ``("127.0.0.1", 0)`` (or a host's address) for a TCP socket that processes may join from elsewhere.
    """
    manager = GroupingManager(address=address, authkey=authkey or secrets.token_bytes(32),
                              ctx=multiprocess.get_context("spawn"))
    manager.start(_init_manager_process)
    return manager


def connect_manager(address, authkey: bytes) -> GroupingManager:
    """Join a running grouping manager from an independently started process."""
    manager = GroupingManager(address=tuple(address) if isinstance(address, list) else address, authkey=authkey)
    try:
        manager.connect()
    except _DIED as err:
        raise ManagerDiedError(f"cannot reach the grouping manager at {address}: {err}. Check that the "
                               "launcher is running and that address and authkey are right") from err
    return manager


def manager_address(manager: GroupingManager) -> tuple[Any, bytes]:
    """``(address, authkey)`` to hand to :func:`connect_manager` in another process."""
    return manager.address, bytes(manager._authkey)


def call(proxy, method: str, *args, **kwargs):
    """Call a registry method; a dead manager becomes :class:`ManagerDiedError` (raised at once, no hang)."""
    try:
        return proxy._callmethod(method, args, kwargs)
    except RemoteError as err:
        raise ManagerDiedError(f"the grouping manager failed while running {method}: {err}") from err
    except _DIED as err:
        raise ManagerDiedError(
            f"the grouping manager stopped answering ({type(err).__name__}: {err}) in process {os.getpid()}; "
            "shared grouping state is gone. Restart the run (queued trajectories stay staged on disk and "
            "are re-queued from the pending snapshot)") from err


def open_registry(manager: GroupingManager, name: str, options: dict | None = None, shards: int = 16):
    """Proxy to the registry ``name`` in ``manager`` (created with ``options`` if new)."""
    try:
        return manager.get_registry(name, options, shards)
    except _DIED as err:
        raise ManagerDiedError(f"cannot reach the grouping manager: {err}. Is it still running?") from err
