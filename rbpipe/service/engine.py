"""The engine seam: what differs between a service on this machine (``--engine local``: a ``multiprocess``
manager, weights in a memory-mapped file) and on Ray (``--engine ray``: actors, weights in Ray's object store),
declared once. :func:`open_engine` picks one by name; the service (``workers/serve.py``) calls only these
methods, so no ``engine == "ray"`` test is needed there.

:data:`ENGINES` is the one table of engines: each ``--engine`` name with its service class (here) and its worker
site (where a run's workers live, the launcher's side: ``rbpipe.workers.sites``). A site is named by its import
path and resolved by ``rbpipe.workers.sites.open_site``: the workers sit above the service (docs/ARCHITECTURE.md),
so this module never imports them. Adding an engine is one entry of the table.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from rbpipe.errors import ConfigError
from rbpipe.service.host import ServiceHost
from rbpipe.service.weights import WEIGHTS_PREFIX, SharedWeights, default_weights_dir

LOCAL, RAY = "local", "ray"


class Weights(Protocol):
    """Where the learner publishes its weights for collectors: :class:`~rbpipe.service.weights.SharedWeights`
    or the Ray engine's ``RayWeights``."""

    def publish(self, model: torch.nn.Module, *, version: int, learner_step: int | None = None) -> None: ...

    def unlink(self) -> None: ...


class Engine(Protocol):
    """One engine's side of a service's life: start its host, make its weights, say how workers reach them,
    and clean up after it."""

    kind: str

    def start(self, run_dir: Path, *, listen: tuple[str, int] | None, authkey: bytes, shards: int,
              log: Callable[[str], Any]) -> ServiceHost: ...

    def weights(self, host: ServiceHost, run_dir: Path, numel: int) -> tuple[Weights, dict[str, Any]]: ...

    def endpoint_fields(self, host: ServiceHost) -> dict[str, Any]: ...

    def remove_logs(self, host: ServiceHost, run_dir: Path) -> None: ...

    def host_pids(self, host: ServiceHost) -> dict[str, int]: ...


class LocalEngine:
    """The ``multiprocess`` grouping manager (a Unix socket, or TCP with ``listen``) and a weights file in
    shared memory."""

    kind = "local"

    def start(self, run_dir: Path, *, listen: tuple[str, int] | None, authkey: bytes, shards: int,
              log: Callable[[str], Any]) -> ServiceHost:
        from rbpipe.grouping.manager import start_manager

        return start_manager(address=listen, authkey=authkey)

    def weights(self, host: ServiceHost, run_dir: Path, numel: int) -> tuple[Weights, dict[str, Any]]:
        name = f"{WEIGHTS_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        weights = SharedWeights(default_weights_dir(run_dir) / name, numel, create=True)
        return weights, {"path": str(weights.path), "numel": numel}

    def endpoint_fields(self, host: ServiceHost) -> dict[str, Any]:
        return {}

    def remove_logs(self, host: ServiceHost, run_dir: Path) -> None:
        pass

    def host_pids(self, host: ServiceHost) -> dict[str, int]:
        """None beyond the manager's, which the launcher records itself."""
        return {}


class RayEngine:
    """Registry shards and the coordinator as Ray actors (Ray is connected by the caller), the weights through
    Ray's object store (one ``ray.put`` per version, the ref held by the coordinator actor)."""

    kind = "ray"

    def start(self, run_dir: Path, *, listen: tuple[str, int] | None, authkey: bytes, shards: int,
              log: Callable[[str], Any]) -> ServiceHost:
        from rbpipe.service.ray import RayManager, remove_session_logs

        stale = remove_session_logs(run_dir)  # a killed session's (the caller holds the store's writer lock)
        if stale:
            log(f"removed the shard logs of {len(stale)} killed session(s): {', '.join(stale)}")
        return RayManager.start(shards=shards, log_dir=str(run_dir))

    def weights(self, host: Any, run_dir: Path, numel: int) -> tuple[Weights, dict[str, Any]]:
        from rbpipe.service.ray import RayWeights

        return RayWeights(host.coordinator_actor, numel), {"engine": "ray", "numel": numel}

    def endpoint_fields(self, host: Any) -> dict[str, Any]:
        return {"ray": host.spec()}

    def remove_logs(self, host: Any, run_dir: Path) -> None:
        """The shards' logs: a resumed run requeues from the staging area instead."""
        from rbpipe.service.ray import shard_log_dir

        shutil.rmtree(shard_log_dir(run_dir, host.prefix), ignore_errors=True)

    def host_pids(self, host: Any) -> dict[str, int]:
        """The pids of the actors that host the service (for ``pids.json``)."""
        return host.pids()


@dataclass(frozen=True)
class EngineEntry:
    """One engine of :data:`ENGINES`: its service side and where its workers live."""

    #: the service's side (an :class:`Engine`)
    engine: Callable[[], Engine]
    #: the launcher's side, ``"module:Class"`` of a ``rbpipe.workers.sites.WorkerSite`` built with
    #: ``(cfg, ray_options)``; resolved by ``rbpipe.workers.sites.open_site`` (the workers' layer)
    site: str


#: Every engine, by its ``--engine`` name (iterating gives the names, in the order the errors list them).
ENGINES: Mapping[str, EngineEntry] = {
    LOCAL: EngineEntry(LocalEngine, "rbpipe.workers.sites:LocalSite"),
    RAY: EngineEntry(RayEngine, "rbpipe.workers.sites:RaySite"),
}


def engine_entry(kind: str) -> EngineEntry:
    """The entry of the engine named ``kind`` (``--engine``); an unknown name is refused in one line."""
    entry = ENGINES.get(kind)
    if entry is None:
        raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}, got {kind!r}")
    return entry


def open_engine(kind: str) -> Engine:
    """The engine named ``kind`` (``--engine``)."""
    return engine_entry(kind).engine()
