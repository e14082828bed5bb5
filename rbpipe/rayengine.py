"""The Ray engine: the same service, workers and grouping on a Ray cluster (``rbpipe run --engine ray``).

What runs where (``docs/RAY.md`` explains the choices):

* **Grouping shards.** ``K`` :class:`ShardHost` actors (``--grouping-shards K``). Each hosts plain
  :class:`~rbpipe.grouping.registry.GroupRegistry` objects by name, exactly as the ``multiprocess`` grouping
  manager does, so torchrl's ``MCAdvantage`` decisions are unchanged. A group key goes to shard
  ``crc32(key) % K`` (:func:`shard_of`, stable across processes and runs), so no shard sees every trajectory.
* **Coordinator and lease authority.** One :class:`CoordinatorHost` actor holds the service's
  :class:`~rbpipe.coordinator.Coordinator` (work units, rate-limit band, learner progress), grants every lease and
  holds the latest weights' object ref. A lease is granted there and *adopted* by every shard (each keeps a
  :class:`~rbpipe.grouping.leases.LeaseTable` of its own); heartbeats renew it on the coordinator and, while it
  lives there, on every shard. Checking a claim's owner never leaves the shard.
* **Clients unchanged.** :class:`ShardedRegistry` and :class:`CoordinatorProxy` answer
  ``_callmethod(method, args, kwargs)`` like ``multiprocess`` proxies, so :class:`SharedMCAdvantage`,
  :func:`rbpipe.grouping.manager.call`, the collectors and the learner run the same code on both engines.
* **Payloads** stay in the file staging area under the store (a path every node sees); only handles and the
  reward cross a shard. **Weights**: one ``ray.put`` per version (:class:`RayWeights`).
* **Workers**: collectors and the learner run as Ray actors (:class:`RayContext` gives the launcher's supervisor
  a ``Process``-like handle on each), placed by Ray with ``num_cpus`` and custom ``resources``.

Ray is imported lazily: nothing here runs for ``--engine local``.
"""

from __future__ import annotations

import functools
import json
import os
import time
import traceback
import uuid
import zlib
from typing import Any

from rbpipe.errors import ConfigError, ManagerDiedError

COORDINATOR_NAME = "rbpipe-coordinator"
SHARD_PREFIX = "rbpipe-shard-"
#: Ray decides the node IP from the machine's interface. Without ``--ray-address`` the engine starts a private
#: instance on loopback: this variable (read by Ray when it is imported) makes the driver, the head and every
#: process Ray starts use 127.0.0.1.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: Seconds between a shard's batched notices of appends to the coordinator (a unit is done when its samples
#: were handed over: the coordinator learns it this much later).
NOTIFY_S = 0.02
#: Seconds a caller waits for a shard that Ray restarts (it replays its log) before the run fails.
RESTART_WAIT_S = 60.0
#: Seconds the coordinator caches the grouping counters it reads on every change (dropped groups move the band).
STATS_CACHE_S = 0.25


def use_loopback() -> None:
    """Keep this process and every Ray process it starts on 127.0.0.1: the variable for processes started from
    now on, and Ray's constant in this one if Ray was imported already (torchrl imports it when installed)."""
    import sys

    os.environ[LOOPBACK_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


def _ray():
    import ray

    return ray


def shard_of(group, shards: int) -> int:
    """The registry shard of group key ``group``: a hash that is the same in every process and every run
    (Python's ``hash`` of a str is salted per process)."""
    if shards <= 1:
        return 0
    if isinstance(group, bool) or not isinstance(group, int):
        try:
            group = int(group)  # numpy / 0-d tensor ints hash like ints
        except (TypeError, ValueError):
            return zlib.crc32(repr(group).encode()) % shards
    return zlib.crc32(str(group).encode()) % shards


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


# -- actors ------------------------------------------------------------------------------------------------------
#: Registry calls that change a shard's state: written to the shard's log first, replayed after a restart.
LOGGED = ("append", "confirm", "quarantine", "reset_stats", "clear_queues", "restore")


@functools.lru_cache(maxsize=1)
def _registry_class():
    from rbpipe.grouping.registry import GroupRegistry

    class ShardRegistry(GroupRegistry):
        """A registry whose claim ids derive from the members' handles: a group formed again when a restarted
        shard replays its log keeps its id, and the store's commits are idempotent by id."""

        def _claim_id(self, members) -> str:
            import hashlib

            return hashlib.sha1("\0".join(sorted(h for _, h, _ in members)).encode()).hexdigest()[:32]

    return ShardRegistry


class ShardHost:
    """One grouping shard (a Ray actor): registries by name, each a plain ``GroupRegistry`` whose owners are
    checked against this shard's own lease table.

    With ``log_dir`` (the service's: under the store, a path that survives the actor) every call that changes
    state is appended to ``shard-<index>.log`` before it runs; an actor that Ray restarts (``max_restarts``)
    replays it, so its queued groups, unconfirmed claims and counters come back as they were. A writer whose
    call was cut off by the restart calls again (the router retries): an append of a handle the shard already
    has is answered, not queued twice."""

    def __init__(self, index: int, namespace: str, ttl_s: float, coordinator: str = COORDINATOR_NAME,
                 log_dir: str | None = None) -> None:
        import threading

        import torch

        from rbpipe.grouping.leases import LeaseTable

        torch.set_num_threads(1)  # decisions are tiny tensor ops
        self.index, self.namespace, self.coordinator_name = index, namespace, coordinator
        self.leases = LeaseTable(ttl_s)
        self.registries: dict[str, Any] = {}
        self._seen: dict[str, set] = {}  # handles appended, per registry
        self._coordinator = None
        self._events: list[tuple] = []
        self._events_lock = threading.Lock()
        self._flusher = None
        self._log = None
        self.replayed = 0
        self._grace_until = time.monotonic() + ttl_s  # after a restart: leases the shard forgot are taken in
        if log_dir:
            from pathlib import Path

            path = Path(log_dir) / f"shard-{index}.log"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.replayed = self._replay(path)
            self._log = open(path, "ab")  # noqa: SIM115 - open for the actor's life

    def pid(self) -> int:
        return os.getpid()

    def open(self, name: str, options: dict | None, staging: dict | None) -> dict:
        reg = self.registries.get(name)
        if reg is None:
            if options is None:
                raise KeyError(f"no grouping registry named {name!r} on shard {self.index}")
            self._write(("open", name, options, staging))
            reg = self._new_registry(name, options, staging)
        return reg.join_info()

    def _new_registry(self, name: str, options: dict, staging: dict | None):
        reg = self.registries[name] = _registry_class()(options, shards=1, staging=staging, leases=self.leases)
        reg.on_append = functools.partial(self._appended, name)
        return reg

    # -- the log --
    def _write(self, record: tuple) -> None:
        if self._log is not None:
            import cloudpickle  # options may hold a user's selector object

            data = cloudpickle.dumps(record)
            self._log.write(len(data).to_bytes(8, "little") + data)
            self._log.flush()  # in the OS's hands: survives the actor's process

    def _replay(self, path) -> int:
        import pickle

        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return 0
        pos = count = 0
        while pos + 8 <= len(data):
            size = int.from_bytes(data[pos:pos + 8], "little")
            if pos + 8 + size > len(data):
                break  # a record cut short by the kill: it never ran
            record = pickle.loads(data[pos + 8:pos + 8 + size])
            pos += 8 + size
            count += 1
            if record[0] == "open":
                reg = self._new_registry(*record[1:])
                reg.on_append, reg._orphan_check_s = None, float("inf")  # the coordinator saw these already
                continue
            _, name, method, args = record
            try:
                self._apply(name, method, args)
            except Exception:  # noqa: BLE001 - it raised the first time too (its caller was told)
                pass
        os.truncate(path, pos)
        for name, reg in self.registries.items():
            reg.on_append, reg._orphan_check_s = functools.partial(self._appended, name), 0.5
            for claim in reg._claims.values():  # owners alive for one lease: a live one's heartbeat keeps it
                if isinstance(claim["owner"], str):
                    self.leases.adopt(claim["owner"])
        return count

    def _apply(self, name: str, method: str, args: tuple):
        if method == "append":
            self._seen.setdefault(name, set()).add(args[1])
        return getattr(self.registries[name], method)(*args)

    def _answer_again(self, reg, handle: str) -> dict:
        """A retried append of ``handle``: the claim it is in, else queued (or already written or dropped)."""
        with reg._claims_lock:
            for claim in reg._claims.values():
                if any(h == handle for h, _ in claim["members"]):
                    return {"status": "write", **reg._public(claim), "recovered": []}
        return {"status": "queued", "recovered": []}

    def _appended(self, name: str, group, owner) -> None:
        """Tell the coordinator (work units) about an append: batched, flushed every :data:`NOTIFY_S` by a
        thread of this actor, never waited for. One Ray call per trajectory cost the shard more than its
        grouping decision (a task submission each)."""
        with self._events_lock:
            self._events.append((name, group, owner))
            if self._flusher is None:
                import threading

                self._flusher = threading.Thread(target=self._flush_loop, daemon=True, name="rbpipe-notify")
                self._flusher.start()

    def _flush_loop(self) -> None:
        while True:
            time.sleep(NOTIFY_S)
            self.flush()

    def flush(self) -> None:
        with self._events_lock:
            events, self._events = self._events, []
        if events:
            if self._coordinator is None:
                self._coordinator = _ray().get_actor(self.coordinator_name, namespace=self.namespace)
            self._coordinator.appended_many.remote(events)  # fire and forget: the shard never waits on it

    def call(self, name: str, method: str, args: tuple, kwargs: dict):
        from rbpipe.grouping.registry import GroupRegistry

        if method not in GroupRegistry.exposed:
            raise AttributeError(f"GroupRegistry has no remote method {method!r}")
        if kwargs:
            raise TypeError("shard calls take positional arguments")
        if method == "append":
            if args[1] in self._seen.get(name, ()):
                return self._answer_again(self.registries[name], args[1])
            if self.replayed and time.monotonic() < self._grace_until and not self.leases.alive(args[3]):
                self.leases.adopt(args[3])  # restarted: a writer's lease is known again at its next heartbeat
        if method in LOGGED:
            self._write(("call", name, method, tuple(args)))
        return self._apply(name, method, tuple(args))

    def adopt(self, token: str) -> None:
        self.leases.adopt(token)

    def release(self, token: str) -> None:
        self.leases.release(token)


class CoordinatorHost:
    """The service's coordinator (a Ray actor): work units, learner progress, the lease authority, the weights."""

    def __init__(self, ttl_s: float) -> None:
        import torch

        from rbpipe.grouping.leases import LEASES

        torch.set_num_threads(1)
        LEASES.ttl_s = float(ttl_s)  # the table the Coordinator checks: this process's, the authority
        self.leases = LEASES
        self.coordinators: dict[str, Any] = {}
        self.weights: tuple[int, int, list | None] = (0, 0, None)

    def pid(self) -> int:
        return os.getpid()

    def configure(self, name: str, settings: dict, registry) -> None:
        from rbpipe.coordinator import Coordinator

        if name not in self.coordinators:
            self.coordinators[name] = Coordinator(**settings, registry=_CachedStats(registry))

    def has(self, name: str) -> bool:
        return name in self.coordinators

    def call(self, name: str, method: str, args: tuple, kwargs: dict):
        from rbpipe.coordinator import Coordinator

        if method not in Coordinator.exposed:
            raise AttributeError(f"Coordinator has no remote method {method!r}")
        return getattr(self.coordinators[name], method)(*args, **kwargs)

    def appended_many(self, events: list[tuple]) -> None:
        """Appends the shards saw, in their order: ``[(registry name, group, owner lease), ...]``."""
        for name, group, owner in events:
            coordinator = self.coordinators.get(name)
            if coordinator is not None:
                coordinator.appended(group, owner)

    # leases: granted here, adopted by the shards
    def lease(self) -> str:
        return self.leases.grant()

    def renew(self, token) -> bool:
        return self.leases.renew(token) if isinstance(token, str) else False

    def release_lease(self, token) -> None:
        if isinstance(token, str):
            self.leases.release(token)

    def lease_ttl(self) -> float:
        return self.leases.ttl_s

    # weights: the latest version's object ref (one ``ray.put`` per version, by the publisher)
    def set_weights(self, version: int, learner_step: int | None, refs: list) -> None:
        step = self.weights[1] if learner_step is None else int(learner_step)
        self.weights = (int(version), step, refs)

    def weights_version(self) -> tuple[int, int]:
        return self.weights[0], self.weights[1]

    def get_weights(self) -> tuple[int, list | None]:
        return self.weights[0], self.weights[2]

    def close(self) -> None:
        for coordinator in self.coordinators.values():
            coordinator.close()


class _CachedStats:
    """What the coordinator reads of the registry (dropped groups move the band), at most every
    :data:`STATS_CACHE_S`: it saves its state on every append and must not fan out to every shard each time."""

    def __init__(self, registry) -> None:
        self.registry, self._stats, self._at = registry, {}, -1e9

    def get_stats(self) -> dict:
        now = time.monotonic()
        if now - self._at > STATS_CACHE_S:
            self._stats, self._at = self.registry.get_stats(), now
        return self._stats


class _WorkerHost:
    """A collector or the learner (a Ray actor): ``run`` is the worker's whole loop."""

    def info(self) -> dict:
        ray = _ray()
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def run(self, fn, args: tuple) -> None:
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - reported by the supervisor as a failed worker
            print(f"[ray worker] failed: {type(err).__name__}: {err}", flush=True)
            traceback.print_exc()
            raise


# -- client side ---------------------------------------------------------------------------------------------------
class _Proxy:
    def __getattr__(self, method: str):
        if method.startswith("_") or method not in self._exposed():
            raise AttributeError(method)
        return lambda *args, **kwargs: self._callmethod(method, args, kwargs)


class CoordinatorProxy(_Proxy):
    """The coordinator actor as a ``multiprocess``-style proxy of one service's coordinator."""

    def __init__(self, actor, name: str) -> None:
        self._actor, self._name = actor, name

    @staticmethod
    def _exposed():
        from rbpipe.grouping.manager import COORDINATOR_EXPOSED

        return COORDINATOR_EXPOSED

    def _callmethod(self, method: str, args=(), kwargs=None):
        return _get(self._actor.call.remote(self._name, method, tuple(args), dict(kwargs or {})), "coordinator")


_SUM_LISTS = ("clear_queues", "quarantined")


class ShardedRegistry(_Proxy):
    """A grouping registry partitioned over ``K`` shard actors, answering like one ``GroupRegistry`` proxy.

    ``append`` goes to the group's shard; ``confirm``/``quarantine`` to the shard that issued the claim
    (remembered from the answers, else asked of all); ``recover`` and every counter are gathered from all
    shards; leases are granted by the coordinator and adopted by every shard."""

    def __init__(self, name: str, shards: list, coordinator, restart_wait_s: float = 0.0) -> None:
        self._name, self._shards, self._coordinator = name, list(shards), coordinator
        self._restart_wait_s = float(restart_wait_s)
        self._claim_shard: dict[str, int] = {}

    def __getstate__(self) -> dict:
        return {"_name": self._name, "_shards": self._shards, "_coordinator": self._coordinator,
                "_restart_wait_s": self._restart_wait_s}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._claim_shard = {}

    @staticmethod
    def _exposed():
        from rbpipe.grouping.registry import GroupRegistry

        return GroupRegistry.exposed

    @property
    def shards(self) -> int:
        return len(self._shards)

    def _one(self, index: int, method: str, *args):
        return self._shard_get(lambda: self._shards[index].call.remote(self._name, method, args, {}))

    def _all(self, method: str, *args) -> list:
        return self._shard_get(lambda: [s.call.remote(self._name, method, args, {}) for s in self._shards])

    def _shard_get(self, submit):
        """Shard calls; while a shard that Ray restarts comes back (it replays its log), the call is made
        again, for up to ``restart_wait_s`` (every shard call is safe to repeat)."""
        ray = _ray()
        deadline = time.monotonic() + self._restart_wait_s
        while True:
            try:
                return _get(submit())
            except ManagerDiedError as err:
                if not isinstance(err.__cause__, ray.exceptions.RayActorError) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _remember(self, index: int, decisions: list[dict]) -> None:
        for decision in decisions:
            if "claim_id" in decision:
                self._claim_shard[decision["claim_id"]] = index

    def _callmethod(self, method: str, args=(), kwargs=None):
        args, kwargs = tuple(args), dict(kwargs or {})
        if kwargs:
            handler = getattr(self, f"_do_{method}", None)
            if handler is None:
                raise TypeError(f"{method}: keyword arguments are not supported by the sharded registry")
            return handler(*args, **kwargs)
        handler = getattr(self, f"_do_{method}", None)
        if handler is not None:
            return handler(*args)
        if method in _SUM_LISTS:
            return [x for part in self._all(method, *args) for x in part]
        if method in ("options", "join_info", "ping"):
            return self._one(0, method, *args)
        if method in ("reset_stats", "watch_temporary"):
            self._all(method, *args)
            return None
        raise NotImplementedError(f"{method} is not available on a sharded registry")

    # -- the one call per trajectory --
    def _do_append(self, group, handle, reward, owner, reserve_rows: bool = False) -> dict:
        if reserve_rows and len(self._shards) > 1:
            raise ConfigError("reserve_rows (torchrl storages without append_group) needs one registry: "
                              "use an rbpipe store (Arrow/Zarr) with --grouping-shards > 1")
        index = shard_of(group, len(self._shards))
        result = self._one(index, "append", group, handle, reward, owner, reserve_rows)
        self._remember(index, [result])
        self._remember(index, result.get("recovered", ()))
        return result

    def _do_confirm(self, claim_id: str) -> bool:
        index = self._claim_shard.pop(claim_id, None)
        if index is not None:
            return self._one(index, "confirm", claim_id)
        return any(self._all("confirm", claim_id))

    def _do_quarantine(self, claim_id: str, reason: str):
        index = self._claim_shard.pop(claim_id, None)
        if index is not None:
            return self._one(index, "quarantine", claim_id, reason)
        return next((r for r in self._all("quarantine", claim_id, reason) if r is not None), None)

    def _do_recover(self, owner, force: bool = False) -> list[dict]:
        taken = []
        for index, part in enumerate(self._all("recover", owner, force)):
            self._remember(index, part)
            taken.extend(part)
        return taken

    # -- counters, summed over shards --
    def _do_get_stats(self) -> dict:
        parts = self._all("get_stats")
        stats = dict(parts[0])
        for part in parts[1:]:
            for name, value in part.items():
                if name in ("trajectory_return_max", "max_queued_trajectories_per_group"):
                    stats[name] = max(stats[name], value)
                else:
                    stats[name] += value
        return stats

    def _do_drop_reasons(self) -> dict:
        total: dict[str, int] = {}
        for part in self._all("drop_reasons"):
            for name, value in part.items():
                total[name] = total.get(name, 0) + value
        return total

    def _do_snapshot(self) -> dict:
        snaps = self._all("snapshot")
        merged = dict(snaps[0], queued=[], claims=[], quarantined=[], drop_reasons=self._do_drop_reasons(),
                      stats=self._do_stats_of(snaps))
        for snap in snaps:
            merged["queued"].extend(snap["queued"])
            merged["claims"].extend(snap["claims"])
            merged["quarantined"].extend(snap["quarantined"])
        return merged

    @staticmethod
    def _do_stats_of(snaps: list[dict]) -> dict:
        raw = dict(snaps[0]["stats"])
        for snap in snaps[1:]:
            for name, value in snap["stats"].items():
                raw[name] = max(raw[name], value) if name == "trajectory_return_max" else raw[name] + value
        return raw

    def _do_restore(self, snap: dict) -> int:
        k = len(self._shards)
        parts = [dict(snap, queued=[], claims=[], quarantined=[], drop_reasons={},
                      stats={n: (v if i == 0 else (float("-inf") if n == "trajectory_return_max" else 0))
                             for n, v in snap["stats"].items()}) for i in range(k)]
        parts[0]["quarantined"], parts[0]["drop_reasons"] = snap.get("quarantined", []), snap.get("drop_reasons", {})
        for group, members in snap["queued"]:
            parts[shard_of(group, k)]["queued"].append((group, members))
        for claim in snap["claims"]:
            parts[shard_of(claim["group"], k)]["claims"].append(claim)
        return sum(self._shard_get(lambda: [s.call.remote(self._name, "restore", (p,), {})
                                            for s, p in zip(self._shards, parts)]))

    # -- leases: the coordinator is the authority, every shard adopts --
    def _do_lease(self) -> str:
        token = _get(self._coordinator.lease.remote(), "coordinator")
        self._shard_get(lambda: [s.adopt.remote(token) for s in self._shards])
        return token

    def _do_renew(self, token) -> bool:
        alive = _get(self._coordinator.renew.remote(token), "coordinator")
        if alive:  # not waited for: a shard that Ray is restarting must not hold the heartbeat up
            for shard in self._shards:  # (the lease would then expire on the coordinator, the authority)
                shard.adopt.remote(token)
        return alive

    def _do_release(self, token) -> None:
        _get(self._coordinator.release_lease.remote(token), "coordinator")
        self._shard_get(lambda: [s.release.remote(token) for s in self._shards])

    def _do_lease_ttl(self) -> float:
        return _get(self._coordinator.lease_ttl.remote(), "coordinator")


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
              prefix: str | None = None, log_dir: str | None = None, shard_restarts: int = 3) -> "RayManager":
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
        coordinator = ray.remote(CoordinatorHost).options(name=prefix + COORDINATOR_NAME, **common).remote(ttl)
        logs = None if log_dir is None else os.path.join(str(log_dir), f"{prefix}shards")
        restarts = int(shard_restarts) if logs else 0
        hosts = [ray.remote(ShardHost).options(name=f"{prefix}{SHARD_PREFIX}{i}", **dict(common, max_restarts=restarts))
                 .remote(i, ns, ttl, prefix + COORDINATOR_NAME, logs) for i in range(int(shards))]
        _get([coordinator.pid.remote()] + [h.pid.remote() for h in hosts])
        return cls(ns, prefix, coordinator, hosts, owner=True, restart_wait_s=RESTART_WAIT_S if restarts else 0.0)

    @classmethod
    def connect(cls, spec: dict) -> "RayManager":
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
            ray.init(address=spec["address"], namespace=spec["namespace"], logging_level="WARNING")
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
        _get([s.open.remote(name, options, staging) for s in self.shard_actors])
        return ShardedRegistry(name, self.shard_actors, self.coordinator_actor, self.restart_wait_s)

    def get_coordinator(self, name: str, settings: dict | None = None) -> CoordinatorProxy:
        if settings is not None:
            registry = ShardedRegistry(name, self.shard_actors, self.coordinator_actor, self.restart_wait_s)
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
            ray.get(self.coordinator_actor.close.remote(), timeout=10)
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
    have until the next version."""

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
        from rbpipe.demo.policy import flat_parameters

        ref = _ray().put(flat_parameters(model).detach().clone())
        self._refs = [ref]
        _get(self._coordinator.set_weights.remote(int(version), learner_step, [ref]), "coordinator")

    def load_into(self, model, *, timeout: float = 30.0) -> int:
        from rbpipe.demo.policy import load_flat_parameters

        ray = _ray()
        version, refs = _get(self._coordinator.get_weights.remote(), "coordinator")
        if not refs:
            raise TimeoutError("no weights published yet")
        try:
            flat = ray.get(refs[0], timeout=timeout)
        except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError):
            return getattr(self, "_loaded", 0)
        load_flat_parameters(model, flat)
        self._loaded = version
        return version

    def unlink(self) -> None:
        self._refs = []


# -- workers as Ray actors -------------------------------------------------------------------------------------------
class RayProcess:
    """A worker actor seen through the few ``multiprocess.Process`` members the launcher's supervisor uses."""

    def __init__(self, fn, args: tuple, name: str, options: dict) -> None:
        self.fn, self.args, self.name, self.options = fn, tuple(args), name, dict(options)
        self.actor = self.ref = self._info = None
        self.pid: int | None = None
        self.node_id: str | None = None
        self._exitcode: int | None = None

    def start(self, wait_s: float = 20.0) -> None:
        """Create the actor and start its loop. Waits up to ``wait_s`` for Ray to place it (for its pid and
        node); an actor still waiting for a node with its resources (one that was removed) keeps waiting
        without holding up the supervisor, and starts once such a node joins."""
        ray = _ray()
        self.actor = ray.remote(_WorkerHost).options(**self.options).remote()
        self._info = self.actor.info.remote()
        self.ref = self.actor.run.remote(self.fn, self.args)
        self.placement(wait_s)

    def placement(self, wait_s: float = 0.0) -> dict:
        """``{"pid", "node_id"}`` once Ray placed the actor (``None`` values while it waits for a node)."""
        if self.node_id is None and self._info is not None:
            ray = _ray()
            if ray.wait([self._info], timeout=wait_s)[0]:
                try:
                    info = ray.get(self._info)
                    self.pid, self.node_id = info["pid"], info["node_id"]
                except Exception:  # noqa: BLE001 - died before it answered: exitcode tells
                    self._info = None
        return {"pid": self.pid, "node_id": self.node_id}

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
        resources: ``{"learner": {...}, "collectors": [{...}, ...]}`` custom resources per worker (collector
            ``i`` takes entry ``i % len``), e.g. ``{"collectors": [{"node_b": 0.01}, {"node_c": 0.01}]}``.
        namespace: where the actors are named (``collector-<id>-<start>``, ``learner-<start>``).
    """

    def __init__(self, entries: dict, *, num_cpus: float = 1, resources: dict | None = None,
                 namespace: str | None = None) -> None:
        self.entries, self.num_cpus, self.resources = entries, float(num_cpus), resources or {}
        self.namespace = namespace
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
        if self.namespace:
            options["namespace"] = self.namespace
        if resources:
            options["resources"] = dict(resources)
        return _PlacedProcess(self, self.entries[target], args, worker, options)


class _PlacedProcess(RayProcess):
    def __init__(self, ctx: RayContext, *args) -> None:
        super().__init__(*args)
        self._ctx = ctx

    def start(self, wait_s: float = 20.0) -> None:
        super().start(wait_s)
        self._ctx.processes.append(self)


class RaySession:
    """Ray for one run: joins ``address`` (a running cluster), or starts a private instance bound to loopback
    that :meth:`close` shuts down; inside a process already connected to Ray it uses that connection."""

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None,
                 namespace: str | None = None) -> None:
        self.address, self.num_cpus = address, num_cpus
        self.namespace = namespace or f"rbpipe-{uuid.uuid4().hex[:10]}"
        self._owned = False

    def start(self) -> "RaySession":
        if self.address is None:
            use_loopback()
        try:
            ray = _ray()
        except ImportError as err:
            raise ConfigError("--engine ray needs Ray: pip install -e '.[ray]' (or pip install 'ray>=2.9')") from err
        if ray.is_initialized():
            self.namespace = ray.get_runtime_context().namespace
            return self
        if self.address is not None:
            ray.init(address=self.address, namespace=self.namespace, logging_level="WARNING")
        else:
            use_loopback()
            ray.init(num_cpus=self.num_cpus, namespace=self.namespace, include_dashboard=False,
                     _node_ip_address="127.0.0.1", logging_level="WARNING")
        self._owned = True
        return self

    def close(self) -> None:
        if self._owned:
            _ray().shutdown()
            self._owned = False


def parse_resources(text: str | None) -> dict:
    """``--ray-resources`` JSON: ``{"learner": {...}, "collectors": [{...}, ...]}`` (custom resources)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"--ray-resources must be JSON such as "
                          f"'{{\"collectors\": [{{\"node_b\": 0.01}}], \"learner\": {{\"head\": 0.01}}}}': {err}") from err
    if not isinstance(value, dict) or set(value) - {"learner", "collectors"} \
            or not isinstance(value.get("collectors", []), list):
        raise ConfigError("--ray-resources: a JSON object with 'learner' (an object) and/or 'collectors' (a list "
                          "of objects, collector i takes entry i modulo its length)")
    return value
