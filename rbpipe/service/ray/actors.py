"""Collectors and the learner as Ray actors, seen by the launcher's supervisor through ``Process``-like handles."""

from __future__ import annotations

import json
import os
import time
import traceback
import uuid
from typing import Any

from rbpipe.errors import ConfigError
from rbpipe.service.ray.common import _ray
from rbpipe.system import fault_hooks


class _WorkerHost:
    """A collector or the learner (a Ray actor): ``run`` is the worker's whole loop.

    An actor that Ray restarted (the learner: ``max_restarts`` > 0) runs ``run`` again (``max_task_retries``),
    with ``restart_kwargs`` added: the learner then takes over from its dead incarnation and resumes from the
    checkpoint. ``incarnation`` tells the supervisor a restarted actor (a new process) from the one it started."""

    def __init__(self) -> None:
        self.incarnation = uuid.uuid4().hex

    def info(self) -> dict:
        ray = _ray()
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "incarnation": self.incarnation}

    def run(self, fn, args: tuple, restart_kwargs: dict | None = None) -> None:
        try:
            restarted = bool(restart_kwargs) and _ray().get_runtime_context().was_current_actor_reconstructed
            fn(*args, **(restart_kwargs if restart_kwargs and restarted else {}))
        except Exception as err:  # noqa: BLE001 - reported by the supervisor as a failed worker
            print(f"[ray worker] failed: {type(err).__name__}: {err}", flush=True)
            traceback.print_exc()
            raise


class RayProcess:
    """A worker actor seen through the few ``multiprocess.Process`` members the launcher's supervisor uses."""

    def __init__(self, fn, args: tuple, name: str, options: dict, restart_kwargs: dict | None = None) -> None:
        self.fn, self.args, self.name, self.options = fn, tuple(args), name, dict(options)
        self.restart_kwargs = dict(restart_kwargs or {})
        # Ray handles: an actor, the ref of its run loop, the ref of its placement info
        self.actor: Any = None
        self.ref: Any = None
        self._info: Any = None
        self.pid: int | None = None
        self.node_id: str | None = None
        self.restarts = 0  # times Ray restarted the actor (seen by :meth:`poll_restarts`)
        self._incarnation: str | None = None
        self._probe = None
        self._probe_at = 0.0
        self._exitcode: int | None = None

    def start(self, wait_s: float = 20.0) -> None:
        """Create the actor and start its loop. Waits up to ``wait_s`` for Ray to place it (for its pid and
        node); an actor still waiting for a node with its resources (one that was removed) keeps waiting
        without holding up the supervisor, and starts once such a node joins."""
        ray = _ray()
        self.actor = ray.remote(_WorkerHost).options(**self.options).remote()
        self._info = self.actor.info.remote()
        self.ref = self.actor.run.remote(self.fn, self.args, self.restart_kwargs)
        self.placement(wait_s)

    def placement(self, wait_s: float = 0.0) -> dict:
        """``{"pid", "node_id"}`` once Ray placed the actor (``None`` values while it waits for a node)."""
        if self.node_id is None and self._info is not None:
            ray = _ray()
            if ray.wait([self._info], timeout=wait_s)[0]:
                try:
                    info = ray.get(self._info)
                    self.pid, self.node_id = info["pid"], info["node_id"]
                    self._incarnation = info["incarnation"]
                except Exception:  # noqa: BLE001 - died before it answered: exitcode tells
                    self._info = None
        return {"pid": self.pid, "node_id": self.node_id}

    def poll_restarts(self, every_s: float = 1.0) -> int:
        """How many times Ray restarted this actor so far (an actor with ``max_restarts``), as far as seen: one
        ``info`` call in flight at a time, never waited for; a new incarnation updates ``pid`` and ``node_id``."""
        if self.actor is None or self._incarnation is None:
            return self.restarts
        ray = _ray()
        if self._probe is None:
            if time.monotonic() - self._probe_at >= every_s:
                self._probe, self._probe_at = self.actor.info.remote(), time.monotonic()
        elif ray.wait([self._probe], timeout=0)[0]:
            probe, self._probe = self._probe, None
            try:
                info = ray.get(probe)
            except Exception:  # noqa: BLE001 - dead for good: exitcode tells
                return self.restarts
            if info["incarnation"] != self._incarnation:
                self.restarts += 1
                self._incarnation, self.pid, self.node_id = info["incarnation"], info["pid"], info["node_id"]
        return self.restarts

    def is_alive(self) -> bool:
        if self.ref is None:
            return False
        return not _ray().wait([self.ref], timeout=0)[0]

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is None and self.ref is not None and not self.is_alive():
            ray = _ray()
            try:
                ray.get(self.ref)
                self._exitcode = 0
            except ray.exceptions.RayActorError:
                self._exitcode = -9  # killed (ray.kill, its node removed): reported as SIGKILL
            except Exception:  # noqa: BLE001 - the loop raised
                self._exitcode = 1
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        if self.ref is not None:
            _ray().wait([self.ref], timeout=timeout)

    def terminate(self) -> None:
        if self.actor is not None:
            _ray().kill(self.actor)

    kill = terminate


class RayContext:
    """What the launcher's supervisor takes for a ``multiprocess`` context: ``Process(...)`` starts an actor.

    Args:
        entries: ``{process target: worker loop}`` (``collector_entry`` -> ``run_collector``, ...).
        num_cpus: CPUs each worker actor asks for.
        num_gpus: GPUs each worker actor asks for (``--ray-num-gpus``; 0: none).
        resources: ``{"learner": {...}, "collectors": [{...}, ...]}`` custom resources per worker (collector
            ``i`` takes entry ``i % len``), e.g. ``{"collectors": [{"node_b": 0.01}, {"node_c": 0.01}]}``.
        namespace: where the actors are named (``collector-<id>-<start>``, ``learner-<start>``).
        learner_restarts: how often Ray restarts the learner's actor (it then resumes from its checkpoint).
    """

    def __init__(self, entries: dict, *, num_cpus: float = 1, resources: dict | None = None,
                 namespace: str | None = None, learner_restarts: int = 0, num_gpus: float = 0) -> None:
        self.entries, self.num_cpus, self.resources = entries, float(num_cpus), resources or {}
        self.num_gpus = float(num_gpus)
        self.namespace = namespace
        self.learner_restarts = int(learner_restarts)
        self.started: dict[str, int] = {}
        self.processes: list[RayProcess] = []

    @property
    def placed(self) -> list[dict]:
        """Every worker actor started so far: worker, actor name, pid, node id, resources asked for."""
        return [{"worker": p.name, "actor": p.options["name"], **p.placement(), "resources": p.options.get("resources")}
                for p in self.processes]

    def Process(self, target, args, name: str, daemon: bool = True) -> RayProcess:  # noqa: N802 - mirrors mp
        worker = name.removeprefix("rbpipe ")
        kind, _, index = worker.partition(" ")
        resources = self.resources.get("learner") if kind == "learner" else None
        if kind == "collector" and self.resources.get("collectors"):
            pins = self.resources["collectors"]
            resources = pins[int(index) % len(pins)]
        n = self.started.get(worker, 0)
        self.started[worker] = n + 1
        options = {"num_cpus": self.num_cpus, "name": f"{worker.replace(' ', '-')}-{n}", "max_restarts": 0,
                   "max_concurrency": 2}
        restart_kwargs = None
        if kind == "learner" and self.learner_restarts:
            # Ray restarts the learner's actor (the same actor, a new process) and runs its loop again
            # (max_task_retries: the `run` call cut off by the death is resubmitted; -1 = as often as the actor
            # restarts). A collector is replaced by the supervisor instead (a new actor, its lease expired).
            options.update(max_restarts=self.learner_restarts, max_task_retries=-1)
            restart_kwargs = {"restarted": True}
        if self.num_gpus:
            options["num_gpus"] = self.num_gpus
        if self.namespace:
            options["namespace"] = self.namespace
        hooks = fault_hooks.forwarded_env()  # Ray's workers do not inherit this process's environment
        if hooks and kind == "learner":  # the learner's hooks; a collector has none (and needs no runtime_env)
            options["runtime_env"] = {"env_vars": hooks}
        if resources:
            options["resources"] = dict(resources)
        return _PlacedProcess(self, self.entries[target], args, worker, options, restart_kwargs)


class _PlacedProcess(RayProcess):
    def __init__(self, ctx: RayContext, *args) -> None:
        super().__init__(*args)
        self._ctx = ctx

    def start(self, wait_s: float = 20.0) -> None:
        super().start(wait_s)
        self._ctx.processes.append(self)


def parse_resources(text: str | None) -> dict:
    """``--ray-resources`` JSON: ``{"learner": {...}, "collectors": [{...}, ...]}`` (custom resources)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"--ray-resources must be JSON such as "
                          f"'{{\"collectors\": [{{\"node_b\": 0.01}}], \"learner\": {{\"head\": 0.01}}}}': "
                          f"{err}") from err
    if not isinstance(value, dict) or set(value) - {"learner", "collectors"} \
            or not isinstance(value.get("collectors", []), list):
        raise ConfigError("--ray-resources: a JSON object with 'learner' (an object) and/or 'collectors' (a list "
                          "of objects, collector i takes entry i modulo its length)")
    return value
