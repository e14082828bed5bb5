"""The grouping registry's shards: ``ShardHost`` actors (their log, replayed on a restart) and the
``ShardedRegistry`` router that answers like one ``GroupRegistry`` proxy.

The log (:mod:`rbpipe.service.ray.shardlog`) is JSON, never a pickle: nothing read back from disk is unpickled.
A registry's options are written there when they are plain values and torchrl's built-in selector (what
``rbpipe run/serve`` builds: ``--selector first|uniform|balanced``). Options holding anything else (a user's
``candidate_selector`` object) are not written: every router keeps the options in memory (the opener's own, or
the ``join_info`` a joiner was answered, both received over Ray's wire), and a restarted shard holds that
registry's records until a router re-sends them (:class:`RegistryAwaitsOptions` answers its calls meanwhile; the
router then calls ``open`` again and repeats its call). Why there: the routers have the options anyway, the
coordinator's router among them, and a shard then never waits on another actor while it restarts (the
coordinator waits on shards, so a shard asking the coordinator for them could deadlock).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from rbpipe.errors import ConfigError, ManagerDiedError
from rbpipe.grouping.registry import shard_of, sum_stats
from rbpipe.rundir import SHARD_LOG
from rbpipe.service.ray.common import COORDINATOR_NAME, _get, _Proxy, _ray
from rbpipe.service.ray.shardlog import LOGGED, call_record, open_record, options_fingerprint, read_log
from rbpipe.timing import NOTIFY_S


class RegistryAwaitsOptions(LookupError):
    """A restarted shard replayed a registry whose options were not in its log: the caller re-sends them
    (``ShardHost.open``) and calls again."""


@functools.lru_cache(maxsize=1)
def _registry_class():
    from rbpipe.grouping.registry import GroupRegistry

    class ShardRegistry(GroupRegistry):
        """A registry whose commit ids derive from the members' handles: a group formed again when a restarted
        shard replays its log keeps its id, and the store's commits are idempotent by id."""

        def _commit_id(self, members) -> str:
            import hashlib

            return hashlib.sha1("\0".join(sorted(h for _, h, _ in members)).encode()).hexdigest()[:32]

    return ShardRegistry


class ShardHost:
    """One grouping shard (a Ray actor): registries by name, each a plain ``GroupRegistry`` whose owners are
    checked against this shard's own lease table.

    With ``log_dir`` (the service's: under the store, a path that survives the actor) every call that changes
    state is appended to ``shard-<index>.log`` (JSON lines, :mod:`rbpipe.service.ray.shardlog`) before it runs;
    an actor that Ray restarts (``max_restarts``) replays it, so its queued groups, unconfirmed claims and counters
    come back as they were (a registry whose options are not in the log: once a router re-sends them). A writer whose
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
        self._coordinator: Any = None  # the coordinator actor's handle, looked up on first use
        self._events: list[tuple] = []
        self._events_lock = threading.Lock()
        self._flusher: threading.Thread | None = None
        self._log = None
        #: registries replayed without their options (not in the log): (fingerprint, staging, their records)
        self._held: dict[str, tuple[str, dict | None, list[dict]]] = {}
        self.replayed = 0
        self._grace_until = time.monotonic() + ttl_s  # after a restart: leases the shard forgot are taken in
        if log_dir:
            from pathlib import Path

            from rbpipe.system import fault_hooks

            fault_hooks.hold_shard_restart(lambda: _ray().get_runtime_context().was_current_actor_reconstructed)
            path = Path(log_dir) / SHARD_LOG.format(index=index)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.replayed = self._replay(path)
            self._log = open(path, "ab")  # noqa: SIM115 - open for the actor's life

    def pid(self) -> int:
        return os.getpid()

    def open(self, name: str, options: dict | None, staging: dict | None) -> dict:
        if name in self._held:  # restarted, its options not in the log: a router re-sends them
            if options is None:
                raise RegistryAwaitsOptions(f"grouping registry {name!r} on restarted shard {self.index} awaits "
                                            "its options")
            self._replay_held(name, options)
        reg = self.registries.get(name)
        if reg is None:
            if options is None:
                raise KeyError(f"no grouping registry named {name!r} on shard {self.index}")
            if self._log is not None:
                self._write(open_record(name, options, staging))
            reg = self._new_registry(name, options, staging)
        return reg.join_info()

    def _new_registry(self, name: str, options: dict, staging: dict | None):
        reg = self.registries[name] = _registry_class()(options, shards=1, staging=staging, leases=self.leases)
        reg.on_append = functools.partial(self._appended, name)
        return reg

    # -- the log --
    def _write(self, line: bytes) -> None:
        if self._log is not None:
            self._log.write(line)
            self._log.flush()  # in the OS's hands: survives the actor's process

    def _replay(self, path) -> int:
        records, end = read_log(path)  # JSON: a foreign or corrupted line raises, naming the file
        for record in records:
            name = record["name"]
            if name in self._held:
                self._held[name][2].append(record)
            elif record["op"] == "open" and record["options"] is None:  # kept by the routers, not on disk
                self._held[name] = (record["fingerprint"], record["staging"], [])
            elif record["op"] == "open":
                reg = self._new_registry(name, record["options"], record["staging"])
                reg.on_append, reg._orphan_check_s = None, float("inf")  # the coordinator saw these already
            else:
                self._replay_call(record)
        if path.exists():
            os.truncate(path, end)  # a record cut short by the kill: it never ran
        for name in self.registries:
            self._replayed(name)
        return len(records)

    def _replay_call(self, record: dict) -> None:
        try:
            self._apply(record["name"], record["method"], record["args"])
        except Exception:  # noqa: BLE001 - it raised the first time too (its caller was told)
            pass

    def _replay_held(self, name: str, options: dict) -> None:
        """The options of a registry this restarted shard held back arrived: replay its records now."""
        fingerprint, staging, records = self._held[name]
        if options_fingerprint(options) != fingerprint:
            raise ConfigError(f"grouping registry {name!r} was opened on shard {self.index} with other options "
                              "than the ones re-sent after its restart: build every transform that shares it with "
                              "the same options")
        del self._held[name]
        reg = self._new_registry(name, options, staging)
        reg.on_append, reg._orphan_check_s = None, float("inf")
        for record in records:
            self._replay_call(record)
        self._replayed(name)

    def _replayed(self, name: str) -> None:
        reg = self.registries[name]
        reg.on_append, reg._orphan_check_s = functools.partial(self._appended, name), 0.5
        for claim in reg._claims.values():  # owners alive for one lease: a live one's heartbeat keeps it
            if isinstance(claim["owner"], str):
                self.leases.adopt(claim["owner"])

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

    def _appended(self, name: str, owner, counts: dict) -> None:
        """Tell the coordinator (work units) about an append: batched, flushed every :data:`NOTIFY_S` by a
        thread of this actor, never waited for. One Ray call per trajectory cost the shard more than its
        grouping decision (a task submission each)."""
        with self._events_lock:
            self._events.extend((name, group, owner, n) for group, n in counts.items())
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
        if name in self._held:
            raise RegistryAwaitsOptions(f"grouping registry {name!r} on restarted shard {self.index} awaits its "
                                        "options")
        if method == "append":
            if args[1] in self._seen.get(name, ()):
                return self._answer_again(self.registries[name], args[1])
            if self.replayed and time.monotonic() < self._grace_until and not self.leases.alive(args[3]):
                self.leases.adopt(args[3])  # restarted: a writer's lease is known again at its next heartbeat
        if method in LOGGED and self._log is not None:
            self._write(call_record(name, method, tuple(args)))
        return self._apply(name, method, tuple(args))

    def adopt(self, token: str) -> None:
        self.leases.adopt(token)

    def release(self, token: str) -> None:
        self.leases.release(token)


_SUM_LISTS = ("clear_queues", "quarantined", "unconfirmed")


class ShardedRegistry(_Proxy):
    """A grouping registry partitioned over ``K`` shard actors, answering like one ``GroupRegistry`` proxy.

    ``append`` goes to the group's shard; ``confirm``/``quarantine`` to the shard that issued the claim
    (remembered from the answers, else asked of all); ``recover`` and every counter are gathered from all
    shards; leases are granted by the coordinator and adopted by every shard."""

    def __init__(self, name: str, shards: list, coordinator, restart_wait_s: float = 0.0,
                 opened: tuple[dict, dict | None] | None = None) -> None:
        self._name, self._shards, self._coordinator = name, list(shards), coordinator
        self._restart_wait_s = float(restart_wait_s)
        self._claim_shard: dict[str, int] = {}
        #: ``(options, staging)`` of the registry (its ``join_info``): re-sent to a shard restarted without them
        self._opened = opened

    @classmethod
    def open(cls, name: str, shards: list, coordinator, restart_wait_s: float, options: dict | None,
             staging: dict | None) -> ShardedRegistry:
        """Open (create with ``options``, or join) registry ``name`` on every shard; the router keeps what the
        shards answered (its options, in memory)."""
        router = cls(name, shards, coordinator, restart_wait_s)
        infos = router._shard_get(lambda: [s.open.remote(name, options, staging) for s in router._shards])
        router._opened = (infos[0]["options"], infos[0]["staging"])
        return router

    def __getstate__(self) -> dict:
        return {"_name": self._name, "_shards": self._shards, "_coordinator": self._coordinator,
                "_restart_wait_s": self._restart_wait_s, "_opened": self._opened}

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

    def _all(self, method: str, *args, wait_s: float | None = None) -> list:
        return self._shard_get(lambda: [s.call.remote(self._name, method, args, {}) for s in self._shards], wait_s)

    def _shard_get(self, submit, wait_s: float | None = None):
        """Shard calls; while a shard that Ray restarts comes back (it replays its log), the call is made
        again, for up to ``wait_s`` (default ``restart_wait_s``; every shard call is safe to repeat). A restarted
        shard that awaits the registry's options (not in its log) is sent them first."""
        ray = _ray()
        deadline = time.monotonic() + (self._restart_wait_s if wait_s is None else wait_s)
        reopen = False
        while True:
            try:
                if reopen and self._opened is not None:  # idempotent on the shards that have the registry
                    _get([s.open.remote(self._name, *self._opened) for s in self._shards])
                return _get(submit())
            except ManagerDiedError as err:
                if not isinstance(err.__cause__, ray.exceptions.RayActorError) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
            except RegistryAwaitsOptions:  # a restarted shard without this registry's options (not on disk)
                if time.monotonic() > deadline:
                    raise
                if reopen or self._opened is None:  # a router that has them (another process's) re-sends them
                    time.sleep(0.2)
                reopen = True

    def _remember(self, index: int, decisions: list[dict]) -> None:
        for decision in decisions:
            if "commit_id" in decision:
                self._claim_shard[decision["commit_id"]] = index

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

    def _do_append_many(self, items: list[tuple], owner, reserve_rows: bool = False) -> list[dict]:
        """Item by item, each to its group's shard (a shard logs and dedupes appends one by one)."""
        return [self._do_append(group, handle, reward, owner, reserve_rows) for group, handle, reward in items]

    def _do_confirm(self, commit_id: str) -> bool:
        index = self._claim_shard.pop(commit_id, None)
        if index is not None:
            return self._one(index, "confirm", commit_id)
        return any(self._all("confirm", commit_id))

    def _do_confirm_many(self, commit_ids: list[str], owner=None) -> list[bool]:  # owner: not checked here
        return [self._do_confirm(commit_id) for commit_id in commit_ids]

    def _do_quarantine(self, commit_id: str, reason: str, owner=None):  # owner: not checked here
        index = self._claim_shard.pop(commit_id, None)
        if index is not None:
            return self._one(index, "quarantine", commit_id, reason)
        return next((r for r in self._all("quarantine", commit_id, reason) if r is not None), None)

    def _do_recover(self, owner, force: bool = False) -> list[dict]:
        taken = []
        for index, part in enumerate(self._all("recover", owner, force)):
            self._remember(index, part)
            taken.extend(part)
        return taken

    # -- counters, summed over shards --
    def _do_get_stats(self) -> dict:
        return self.sum_stats(self._all("get_stats"))

    def stats_within(self, wait_s: float) -> dict:
        """The counters, waiting for a shard that Ray restarts for up to ``wait_s`` instead of ``restart_wait_s``
        (the coordinator's final read)."""
        return self.sum_stats(self._all("get_stats", wait_s=wait_s))

    def stats_calls(self) -> list:
        """One ``get_stats`` call to each shard, not waited for: the coordinator actor takes the answers when they
        are there (a call to a shard that Ray is restarting waits until it is back)."""
        return [s.call.remote(self._name, "get_stats", (), {}) for s in self._shards]

    #: the shards' counters as one registry's (the coordinator actor sums the answers of :meth:`stats_calls`)
    sum_stats = staticmethod(sum_stats)

    def _do_drop_reasons(self) -> dict:
        return sum_stats(self._all("drop_reasons"))

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
        _get(self._coordinator.release.remote(token), "coordinator")
        self._shard_get(lambda: [s.release.remote(token) for s in self._shards])

    def _do_lease_ttl(self) -> float:
        return _get(self._coordinator.lease_ttl.remote(), "coordinator")
