"""The coordinator actor (work units, learner progress, lease authority, the latest weights' ref), its proxy,
the weights through Ray's object store, and ``RayManager``, which starts or joins a service's actors."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from rbpipe.errors import ConfigError, ManagerDiedError
from rbpipe.grouping.leases import LeaseAuthority
from rbpipe.rundir import COORDINATOR_SETTINGS, SHARD_LOGS
from rbpipe.service.ray.common import COORDINATOR_NAME, COORDINATOR_THREADS, SHARD_PREFIX, _get, _Proxy, _ray
from rbpipe.service.ray.session import init_ray, use_loopback
from rbpipe.service.ray.shards import RegistryAwaitsOptions, ShardedRegistry, ShardHost
from rbpipe.system import fault_hooks
from rbpipe.system.fsutil import atomic_write_json
from rbpipe.timing import CLOSE_STATS_WAIT_S, RESTART_WAIT_S, STATS_WAIT_S
from rbpipe.timing import RAY_STATS_CACHE_S as STATS_CACHE_S

#: The shards' log directory of a service started with a random prefix (:meth:`RayManager.start`).
_SESSION_LOGS = re.compile(SHARD_LOGS.format(prefix="[0-9a-f]{8}-"))


def shard_log_dir(log_dir: str | os.PathLike[str], prefix: str) -> Path:
    """Where the shards of the service named by ``prefix`` log their state changes."""
    return Path(log_dir) / SHARD_LOGS.format(prefix=prefix)


def remove_session_logs(log_dir: str | os.PathLike[str]) -> list[str]:
    """Remove the shards' logs that services started under ``log_dir`` left there; returns their names.

    Only a service's close removes its own: a killed one leaves them. They are of no use to a resumed run (it
    requeues from the staging area). The caller must own ``log_dir`` (``rbpipe serve`` holds the store's
    writer lock): a live service's logs are replayed when Ray restarts one of its shards."""
    removed = []
    for entry in sorted(Path(log_dir).glob("*shards")):
        if _SESSION_LOGS.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


def _reconstructed() -> bool:
    """Whether this actor's process is a restart by Ray (asked only inside an actor)."""
    try:
        return bool(_ray().get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - not in an actor (a host built in process, in tests)
        return False


class LastKnownStats:
    """The grouping counters as the coordinator actor reads them: the shards' answers when they are there within
    ``STATS_WAIT_S``, else the last ones. A read happens inside the coordinator's lock, which every take and
    report holds; a read that waited for a shard Ray was restarting (seconds) held them all up, and when the
    actor still served one call at a time, lease renewals too: they came past the leases' time to live, so
    live collectors' units were reissued while they still handed them over (a group stored twice).

    A ``fresh`` read (the coordinator's close, which saves the run's final counters) asks the shards anew, waits
    for a restarting one up to ``CLOSE_STATS_WAIT_S`` and sends it the registry's options if it lost them: the
    answers of calls made earlier may predate the last drops, and a shard Ray restarts answers only when back.
    """

    def __init__(self, registry: ShardedRegistry) -> None:
        self._registry = registry
        self._last = registry.get_stats()  # waits for the shards once, when the coordinator is configured
        self._pending: list | None = None
        self._lock = threading.Lock()  # the actor is threaded: one read of the shards at a time

    def get_stats(self, fresh: bool = False) -> dict:
        with self._lock:
            return self._read(fresh)

    def _read(self, fresh: bool) -> dict:
        if fresh:
            self._pending = None
            try:
                self._last = self._registry.stats_within(CLOSE_STATS_WAIT_S)
            except (ManagerDiedError, RegistryAwaitsOptions):
                pass  # a shard down for good: the last counters are the best there are
            return self._last
        if self._pending is None:
            self._pending = self._registry.stats_calls()
        ready, _ = _ray().wait(self._pending, num_returns=len(self._pending), timeout=STATS_WAIT_S)
        if len(ready) == len(self._pending):
            calls, self._pending = self._pending, None
            try:
                self._last = self._registry.sum_stats(_get(calls))
            except (ManagerDiedError, RegistryAwaitsOptions):
                pass  # a shard down or restarted without options: its routers bring it back; ask again next time
        return self._last


class CoordinatorHost(LeaseAuthority):
    """The service's coordinator (a Ray actor): work units, learner progress, the lease authority, the weights.

    A threaded actor (``COORDINATOR_THREADS``), like the local manager that serves each connection on a thread:
    a collector's ``take_many`` waits on the coordinator's condition for the band to move and is answered the
    moment the learner reports, while renewals and reports go on beside it. What it holds is locked: each
    :class:`~rbpipe.service.coordinator.Coordinator` by its own lock, the lease table by its, ``configure`` by
    ``_configuring``; the weights' entry is replaced whole.

    Restarted by Ray when its process dies (with a log directory, as the shards are): ``configure`` saved its
    settings in ``settings_path`` (plain JSON), and the new process configures each coordinator again from them
    and from its ``prompts.json``, which holds the live service's state (``Coordinator(restarted=True)``). The
    lease table restarted empty: for one time to live a lease it does not know is taken in when renewed, as a
    restarted shard does. The weights come back with the learner's next publish; readers keep theirs meanwhile.
    Calls in flight when it died are run again by Ray (``max_task_retries``).
    """

    def __init__(self, ttl_s: float, settings_path: str | None = None, service: dict | None = None) -> None:
        import torch

        from rbpipe.grouping.leases import LEASES

        torch.set_num_threads(1)
        LEASES.ttl_s = float(ttl_s)  # the table the Coordinator checks: this process's, the authority
        self._leases = LEASES  # lease calls: LeaseAuthority's; granted here, adopted by the shards
        self.coordinators: dict[str, Any] = {}
        self._configuring = threading.Lock()
        self.weights: tuple[int, int, list | None] = (0, 0, None)
        self._settings_path = None if settings_path is None else Path(settings_path)
        self._service = dict(service or {})  # namespace, prefix, shards, restart_wait_s: to reach the shards again
        self._configured: dict[str, dict] = {}  # what configure was given, by coordinator name
        self._grace_until = -1.0
        self.restarts = 0
        if self._settings_path is not None and self._settings_path.exists() and _reconstructed():
            self._restore()

    def _restore(self) -> None:
        """(Ray restarted this actor.) Each coordinator again, from its saved settings and ``prompts.json``."""
        from rbpipe.service.coordinator import Coordinator

        assert self._settings_path is not None
        saved = json.loads(self._settings_path.read_text())  # plain JSON: nothing read back is unpickled
        self._service, self._configured = saved["service"], saved["coordinators"]
        self.restarts = int(saved.get("restarts", 0)) + 1
        self._grace_until = time.monotonic() + self._leases.ttl_s
        for name, settings in self._configured.items():
            self.coordinators[name] = Coordinator(**settings, registry=LastKnownStats(self._router(name)),
                                                  stats_cache_s=STATS_CACHE_S, restarted=True,
                                                  restartable=True)
        self._save_settings()

    def _router(self, name: str) -> ShardedRegistry:
        ray, service = _ray(), self._service
        shards = [ray.get_actor(f"{service['prefix']}{SHARD_PREFIX}{i}", namespace=service["namespace"])
                  for i in range(int(service["shards"]))]
        me = ray.get_runtime_context().current_actor
        return ShardedRegistry.open(name, shards, me, float(service["restart_wait_s"]), None, None)

    def _save_settings(self) -> None:
        if self._settings_path is not None:
            self._settings_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self._settings_path, {"service": self._service, "coordinators": self._configured,
                                                    "restarts": self.restarts})

    def renew(self, token) -> bool:
        """:meth:`LeaseAuthority.renew`; for one time to live after a restart, a lease this process never
        granted is taken in (its holder lived through the restart) instead of refused."""
        if super().renew(token):
            return True
        if isinstance(token, str) and time.monotonic() < self._grace_until:
            self._leases.adopt(token)
            return True
        return False

    def pid(self) -> int:
        return os.getpid()

    def configure(self, name: str, settings: dict, registry) -> None:
        from rbpipe.service.coordinator import Coordinator

        with self._configuring:
            if name in self.coordinators:
                return
            self.coordinators[name] = Coordinator(**settings, registry=LastKnownStats(registry),
                                                  stats_cache_s=STATS_CACHE_S,
                                                  restartable=self._settings_path is not None)
            self._configured[name] = dict(settings)
            self._save_settings()

    def has(self, name: str) -> bool:
        return name in self.coordinators

    def call(self, name: str, method: str, args: tuple, kwargs: dict):
        from rbpipe.service.coordinator import Coordinator

        if method not in Coordinator.exposed:
            raise AttributeError(f"Coordinator has no remote method {method!r}")
        return getattr(self.coordinators[name], method)(*args, **kwargs)

    def appended_many(self, events: list[tuple]) -> None:
        """Appends the shards saw, in their order: ``[(registry name, group, owner lease, count), ...]``."""
        for name, group, owner, n in events:
            coordinator = self.coordinators.get(name)
            if coordinator is not None:
                coordinator.appended_many(owner, {group: n})

    # weights: the latest version's object ref (one ``ray.put`` per version, by the publisher)
    def set_weights(self, version: int, learner_step: int | None, refs: list) -> None:
        step = self.weights[1] if learner_step is None else int(learner_step)
        self.weights = (int(version), step, refs)

    def weights_version(self) -> tuple[int, int]:
        return self.weights[0], self.weights[1]

    def get_weights(self) -> tuple[int, list | None]:
        return self.weights[0], self.weights[2]

    def close(self) -> None:
        with self._configuring:
            for coordinator in self.coordinators.values():
                coordinator.close()


class CoordinatorProxy(_Proxy):
    """The coordinator actor as a ``multiprocess``-style proxy of one service's coordinator."""

    def __init__(self, actor, name: str) -> None:
        self._actor, self._name = actor, name

    @staticmethod
    def _exposed():
        from rbpipe.service.api import COORDINATOR_EXPOSED

        return COORDINATOR_EXPOSED

    def _callmethod(self, method: str, args=(), kwargs=None):
        return _get(self._actor.call.remote(self._name, method, tuple(args), dict(kwargs or {})), "coordinator")


class RayManager:
    """Stands where the ``multiprocess`` grouping manager stands (``get_registry``, ``get_coordinator``,
    ``address``, ``shutdown``), backed by one coordinator actor and ``K`` shard actors of a Ray namespace."""

    joined = False

    def __init__(self, namespace: str, prefix: str, coordinator, shards: list, owner: bool,
                 restart_wait_s: float = 0.0) -> None:
        self.namespace, self.prefix = namespace, prefix
        self.coordinator_actor, self.shard_actors = coordinator, list(shards)
        self._owner = owner
        self.restart_wait_s = float(restart_wait_s)

    @classmethod
    def start(cls, *, shards: int = 1, ttl_s: float | None = None, namespace: str | None = None,
              prefix: str | None = None, log_dir: str | None = None, shard_restarts: int = 3) -> RayManager:
        """Create the coordinator and ``shards`` shard actors (0 CPUs each; placed by Ray) and wait for them.
        Their names (``<prefix>rbpipe-coordinator``, ``<prefix>rbpipe-shard-<i>``) are unique per service.
        ``log_dir``: where the shards log their state changes (``<log_dir>/<prefix>shards/``); with it, Ray
        restarts a shard up to ``shard_restarts`` times and the shard replays its log. Without it a dead
        shard fails the run."""
        from rbpipe.grouping.leases import ttl_from_env

        ray = _ray()
        if int(shards) < 1:
            raise ConfigError(f"--grouping-shards must be >= 1, got {shards}")
        ns = namespace or ray.get_runtime_context().namespace
        ttl = ttl_from_env() if ttl_s is None else float(ttl_s)
        prefix = f"{uuid.uuid4().hex[:8]}-" if prefix is None else prefix
        # The shared state lives on the driver's node, as the local manager lives beside its launcher: a worker
        # node that is removed (or preempted) takes only its workers with it. 0 CPUs: they never wait for a slot.
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        common = {"namespace": ns, "num_cpus": 0, "max_restarts": 0, "scheduling_strategy": here}
        hooks = fault_hooks.forwarded_env()  # Ray's workers do not inherit this process's environment
        if hooks:
            common["runtime_env"] = {"env_vars": hooks}
        logs = None if log_dir is None else str(shard_log_dir(log_dir, prefix))
        restarts = int(shard_restarts) if logs else 0
        wait_s = RESTART_WAIT_S if restarts else 0.0
        service = {"namespace": ns, "prefix": prefix, "shards": int(shards), "restart_wait_s": wait_s}
        # restarted by Ray like the shards (calls in flight are run again), when there is a log directory to keep
        # its settings in; its state is in prompts.json
        restart = {"max_restarts": restarts, "max_task_retries": -1} if restarts else {}
        coordinator = (ray.remote(CoordinatorHost)
                       .options(name=prefix + COORDINATOR_NAME, max_concurrency=COORDINATOR_THREADS,
                                **dict(common, **restart))
                       .remote(ttl, str(Path(logs) / COORDINATOR_SETTINGS) if logs else None, service))
        hosts = [ray.remote(ShardHost).options(name=f"{prefix}{SHARD_PREFIX}{i}", **dict(common, max_restarts=restarts))
                 .remote(i, ns, ttl, prefix + COORDINATOR_NAME, logs) for i in range(int(shards))]
        _get([coordinator.pid.remote()] + [h.pid.remote() for h in hosts])
        return cls(ns, prefix, coordinator, hosts, owner=True, restart_wait_s=wait_s)

    @classmethod
    def connect(cls, spec: dict) -> RayManager:
        """Join the actors a service started (``spec``: :meth:`spec`, from ``endpoint.json``)."""
        host = str(spec["address"]).rsplit(":", 1)[0]
        if host.startswith("127.") or host in ("localhost", "::1"):
            use_loopback()  # a service on a private loopback instance: Ray would swap 127.0.0.1 for the NIC's address
        ray = _ray()
        if spec.get("auth_mode") == "token" and "RAY_AUTH_MODE" not in os.environ:
            # a private instance uses Ray's token auth (the token: ~/.ray/auth_token, or RAY_AUTH_TOKEN). Ray read
            # its settings when torchrl imported it: refresh them as ray.init does for a new local cluster.
            try:
                from ray._private.authentication.authentication_token_setup import _enable_token_auth

                _enable_token_auth()
            except ImportError:  # another Ray version: the variable alone
                os.environ["RAY_AUTH_MODE"] = "token"
        if not ray.is_initialized():
            init_ray(address=spec["address"], namespace=spec["namespace"], logging_level="WARNING")
        prefix = spec.get("prefix", "")
        try:
            coordinator = ray.get_actor(prefix + COORDINATOR_NAME, namespace=spec["namespace"])
            shards = [ray.get_actor(f"{prefix}{SHARD_PREFIX}{i}", namespace=spec["namespace"])
                      for i in range(int(spec["shards"]))]
        except ValueError as err:
            raise ManagerDiedError(f"no rbpipe service in Ray namespace {spec['namespace']!r} ({err}): is "
                                   "`rbpipe serve --engine ray` still running?") from err
        return cls(spec["namespace"], prefix, coordinator, shards, owner=False,
                   restart_wait_s=float(spec.get("restart_wait_s", 0.0)))

    @property
    def address(self) -> str:
        return _ray().get_runtime_context().gcs_address

    def spec(self) -> dict:
        return {"address": self.address, "namespace": self.namespace, "prefix": self.prefix,
                "shards": len(self.shard_actors), "auth_mode": os.environ.get("RAY_AUTH_MODE"),
                "restart_wait_s": self.restart_wait_s}

    def get_registry(self, name: str, options: dict | None = None, shards: int = 16, staging: dict | None = None):
        return ShardedRegistry.open(name, self.shard_actors, self.coordinator_actor, self.restart_wait_s, options,
                                    staging)

    def get_coordinator(self, name: str, settings: dict | None = None) -> CoordinatorProxy:
        if settings is not None:  # the coordinator's router: with the registry's options, as every router
            registry = self.get_registry(name)
            _get(self.coordinator_actor.configure.remote(name, settings, registry), "coordinator")
        elif not _get(self.coordinator_actor.has.remote(name), "coordinator"):
            raise ConfigError(f"the Ray namespace {self.namespace!r} runs no rbpipe service ({name!r})")
        return CoordinatorProxy(self.coordinator_actor, name)

    def pids(self) -> dict[str, int]:
        refs = [self.coordinator_actor.pid.remote()] + [s.pid.remote() for s in self.shard_actors]
        pids = _get(refs)
        return {"coordinator": pids[0], **{f"shard {i}": p for i, p in enumerate(pids[1:])}}

    def shutdown(self) -> None:
        if not self._owner:
            return
        ray = _ray()
        try:
            ray.get(self.coordinator_actor.close.remote(), timeout=CLOSE_STATS_WAIT_S + 10)
        except Exception:  # noqa: BLE001 - already gone
            pass
        for actor in [self.coordinator_actor, *self.shard_actors]:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass


class RayWeights:
    """The policy's weights through Ray's object store: the publisher makes one ``ray.put`` per version and
    hands the ref to the coordinator; readers fetch the latest ref and its object (from their node's store).
    A version whose object was lost with its owner (a killed learner) is skipped: readers keep the weights they
    have until the next version.

    The object is ``(dtypes, arrays)``: per parameter, its dtype's name and a byte view of it as a numpy array
    (no copy for a parameter on the CPU). Ray pickles numpy arrays with protocol 5's out-of-band buffers and
    copies each straight into the object store, so a publish makes no whole-vector copy in the learner (a
    concatenated vector would be one, as large as the model, as :class:`~rbpipe.service.weights.SharedWeights`
    avoids too). Readers cast each parameter to their own dtype, as from a flat float32 vector (which they still
    read)."""

    path = None

    def __init__(self, coordinator_actor, numel: int = 0) -> None:
        self._coordinator, self.numel = coordinator_actor, int(numel)
        self._refs: list = []  # the publisher keeps its latest ref alive too

    @property
    def version(self) -> int:
        return int(_get(self._coordinator.weights_version.remote(), "coordinator")[0])

    @property
    def learner_step(self) -> int:
        return int(_get(self._coordinator.weights_version.remote(), "coordinator")[1])

    def publish(self, model, *, version: int, learner_step: int | None = None) -> None:
        ref = _ray().put(parameter_buffers(model))
        self._refs = [ref]
        _get(self._coordinator.set_weights.remote(int(version), learner_step, [ref]), "coordinator")

    def load_into(self, model, *, timeout: float = 30.0) -> int:
        from rbpipe.demo.policy import load_flat_parameters

        ray = _ray()
        version, refs = _get(self._coordinator.get_weights.remote(), "coordinator")
        if not refs:
            loaded: int | None = getattr(self, "_loaded", None)
            if loaded is not None:  # a restarted coordinator, before the learner's next publish: keep ours
                return loaded
            raise TimeoutError("no weights published yet")
        try:
            published = ray.get(refs[0], timeout=timeout)
        except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError):
            return getattr(self, "_loaded", 0)
        if not isinstance(published, tuple):  # a torch.Tensor: one flat float32 vector (what publishers wrote before)
            load_flat_parameters(model, published)
        else:
            load_parameter_buffers(model, published)
        self._loaded = version
        return version

    def unlink(self) -> None:
        self._refs = []


def parameter_buffers(model) -> tuple[list[str], list]:
    """``model``'s parameters as ``(dtype names, numpy byte views)``, one of each per parameter: views of the
    parameters themselves on the CPU (a parameter elsewhere is brought over, one at a time), whatever their dtype
    (bfloat16 has no numpy dtype: its bytes do)."""
    import torch

    dtypes, arrays = [], []
    for p in model.parameters():
        t = p.detach().reshape(-1)
        if t.device.type != "cpu":
            t = t.cpu()
        dtypes.append(str(t.dtype).removeprefix("torch."))
        arrays.append(t.view(torch.uint8).numpy())
    return dtypes, arrays


def load_parameter_buffers(model, published: tuple[list[str], list]) -> None:
    """Copy what :func:`parameter_buffers` published into ``model``, cast to each parameter's dtype and device."""
    import warnings

    import torch

    dtypes, arrays = published
    params = list(model.parameters())
    if len(params) != len(arrays):
        raise ValueError(f"the published weights hold {len(arrays)} parameters, the model has {len(params)}")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the object store's arrays are read-only: only read here
        for p, dtype, array in zip(params, dtypes, arrays, strict=True):
            p.copy_(torch.from_numpy(array).view(getattr(torch, dtype)).view_as(p))
