"""The ``multiprocess`` manager that hosts grouping registries, and calls to it that never hang on a corpse.

Workers started by the launcher receive the proxy with their arguments; independently started processes
join with :func:`connect_manager` (address + authkey) and look a registry up by name.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import multiprocess
from multiprocess.managers import BaseManager, RemoteError

from rbpipe.errors import ManagerDiedError
from rbpipe.grouping.registry import GroupRegistry, get_registry

_DIED = (EOFError, ConnectionError, BrokenPipeError, OSError)


class GroupingManager(BaseManager):
    """Manager process holding :class:`GroupRegistry` objects (its methods run in there)."""


GroupingManager.register("get_registry", callable=get_registry, exposed=GroupRegistry.exposed)


def _ignore_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the workers; the launcher shuts us down


def start_manager(*, address: tuple[str, int] = ("127.0.0.1", 0), authkey: bytes | None = None) -> GroupingManager:
    """Start a grouping manager process (``multiprocess`` spawn). Shut it down with ``manager.shutdown()``."""
    manager = GroupingManager(address=address, authkey=authkey or secrets.token_bytes(32),
                              ctx=multiprocess.get_context("spawn"))
    manager.start(_ignore_sigint)
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
