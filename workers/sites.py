"""Where a run's workers live: processes of this machine (``--engine local``) or Ray actors (``--engine ray``).

Why a module of its own: the launcher supervises workers the same way on both engines (start, watch, restart,
stop); only how they are started and what a run directory records about them differ. This is that difference,
declared once, so the launcher has no ``engine == "ray"`` test (the service's side is
:mod:`rbpipe.service.engine`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol, cast

from rbpipe.config import RunConfig
from rbpipe.rundir import RAY_WORKERS
from rbpipe.service.engine import engine_entry
from rbpipe.system.fsutil import atomic_write_json
from rbpipe.system.procs import worker_context


class WorkerSite(Protocol):
    """What the launcher needs from the place its workers run."""

    #: ``ctx.Process(target=..., args=..., name=..., daemon=True)`` starts one worker
    ctx: Any

    def open(self) -> None:
        """Connect to what hosts the workers (before the service starts)."""

    def record(self, run_dir: Path) -> None:
        """Write what a later command needs to find the workers (after each start or restart)."""

    def close(self, run_dir: Path) -> None:
        """Record a last time and disconnect (after the workers stopped)."""

    def summary_fields(self) -> dict[str, Any]:
        """The site's own fields of ``summary.json``."""


class LocalSite:
    """Worker processes started by ``multiprocess``'s fork server (:func:`rbpipe.system.procs.worker_context`);
    ``pids.json`` already says everything about them.

    Examples:
        >>> site = LocalSite()
        >>> site.open(); site.summary_fields()
        {}
    """

    def __init__(self, cfg: RunConfig | None = None, ray: dict[str, Any] | None = None) -> None:
        self.ctx = worker_context()  # (the run's config and Ray options, which every site is built with: unused)

    def open(self) -> None:
        pass

    def record(self, run_dir: Path) -> None:
        pass

    def close(self, run_dir: Path) -> None:
        pass

    def summary_fields(self) -> dict[str, Any]:
        return {}


class RaySite:
    """Workers as Ray actors in a session of their own (``--ray-address`` joins a cluster; else a local Ray):
    the supervisor's ``ctx.Process`` starts the same loops ``rbpipe run``'s processes run (without the
    process-level wrapping: Ray owns the actor's process). ``ray_workers.json`` names the session's namespace and
    where each actor was placed, for ``rbpipe status`` and the tests.

    Examples:
        >>> from rbpipe.config import RunConfig
        >>> RaySite(RunConfig(), {"grouping_shards": 2}).summary_fields()
        {'grouping_shards': 2}
    """

    def __init__(self, cfg: RunConfig, ray: dict[str, Any]) -> None:
        import functools

        from rbpipe.service.ray import RayContext, parse_resources
        from rbpipe.workers.collector import collector_entry, run_collector
        from rbpipe.workers.learner import learner_entry, run_learner

        resources = ray.get("resources")
        resources = parse_resources(resources) if isinstance(resources, str) else (resources or {})
        entries = {collector_entry: functools.partial(run_collector, announce=False),
                   learner_entry: functools.partial(run_learner, announce=False)}
        self.ctx = RayContext(entries, num_cpus=float(ray.get("num_cpus", 1)),
                              num_gpus=float(ray.get("num_gpus") or 0), resources=resources,
                              learner_restarts=cfg.max_restarts)
        self._address = ray.get("address")
        self._num_cpus = max(2, cfg.collectors + 1)
        self._shards = int(ray.get("grouping_shards") or 1)
        self._session: Any = None  # a RaySession once opened

    def open(self) -> None:
        from rbpipe.service.ray import RaySession

        session = RaySession(self._address, num_cpus=self._num_cpus).start()
        self.ctx.namespace = session.namespace
        self._session = session

    def record(self, run_dir: Path) -> None:
        if self._session is not None:
            atomic_write_json(run_dir / RAY_WORKERS, {"namespace": self.ctx.namespace, "workers": self.ctx.placed})

    def close(self, run_dir: Path) -> None:
        if self._session is not None:
            self.record(run_dir)
            self._session.close()

    def summary_fields(self) -> dict[str, Any]:
        return {"grouping_shards": self._shards}


def open_site(engine: str, cfg: RunConfig, ray: dict[str, Any] | None = None) -> WorkerSite:
    """The site of ``engine`` (``--engine``), as :data:`rbpipe.service.engine.ENGINES` names it (an unknown name
    is refused in one line, as by :func:`rbpipe.service.engine.open_engine`)."""
    module, _, name = engine_entry(engine).site.partition(":")
    return cast(WorkerSite, getattr(importlib.import_module(module), name)(cfg, ray or {}))
