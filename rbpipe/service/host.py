"""The service's coordinator on the grouping manager: registered here, in the service, on
:class:`~rbpipe.grouping.manager.GroupingManager` (grouping knows nothing of the service that builds on it), and
:func:`open_coordinator`, which reaches it on either engine.

Whoever starts a service's manager imports this module first (``workers/serve.py`` does): the manager process
receives the registrations of the process that starts it. A proxy unpickled elsewhere imports this module
through :data:`CoordinatorProxy`'s module, and so registers the same.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from multiprocess.managers import MakeProxyType, RemoteError

from rbpipe.errors import ConfigError
from rbpipe.grouping.manager import GroupingManager, RegistryHost, get_proxy
from rbpipe.service.api import COORDINATOR_EXPOSED


class ServiceHost(RegistryHost, Protocol):
    """What hosts a service (registries and the coordinator): a :class:`GroupingManager` once this module is
    imported, or the Ray engine's ``RayManager``."""

    @property
    def address(self) -> Any: ...

    def get_coordinator(self, name: str, settings: dict | None = None) -> Any: ...

    def shutdown(self) -> None: ...


_COORDINATORS: dict[str, Any] = {}  # the manager process's coordinators, by registry name
_COORDINATORS_LOCK = threading.Lock()


def _get_coordinator(name: str, settings: dict | None = None):
    """Manager-side factory: the coordinator of registry ``name`` (created with ``settings`` on first use),
    which the registry then tells about every append."""
    from rbpipe.grouping.registry import get_registry
    from rbpipe.service.coordinator import Coordinator  # manager-side: only a service's manager builds one

    with _COORDINATORS_LOCK:
        coord = _COORDINATORS.get(name)
        if coord is None:
            if settings is None:
                raise KeyError(f"no coordinator named {name!r} in this service")
            registry = get_registry(name)
            coord = _COORDINATORS[name] = Coordinator(**settings, registry=registry)
            registry.on_append = coord.appended_many
        return coord


CoordinatorProxy = MakeProxyType("CoordinatorProxy", COORDINATOR_EXPOSED)
CoordinatorProxy.__module__ = __name__
GroupingManager.register("get_coordinator", callable=_get_coordinator, proxytype=CoordinatorProxy,
                         exposed=COORDINATOR_EXPOSED)


def open_coordinator(manager: ServiceHost, name: str, settings: dict | None = None):
    """Proxy to the service's :class:`~rbpipe.service.coordinator.Coordinator` of registry ``name`` (created with
    ``settings``, after the registry, by the service; joined by workers)."""
    try:
        return get_proxy(manager, "get_coordinator", name, settings, died="Is the service still running?")
    except RemoteError as err:
        raise ConfigError(f"the manager at {manager.address} runs no rbpipe service ({name!r}): attach to the "
                          "address `rbpipe serve` wrote in RUN_DIR/endpoint.json") from err
