"""The Ray engine: the same service, workers and grouping on a Ray cluster (``rbpipe run --engine ray``).

What runs where (``docs/RAY.md`` explains the choices):

* **Grouping shards.** ``K`` :class:`ShardHost` actors (``--grouping-shards K``). Each hosts plain
  :class:`~rbpipe.grouping.registry.GroupRegistry` objects by name, exactly as the ``multiprocess`` grouping
  manager does, so torchrl's ``MCAdvantage`` decisions are unchanged. A group key goes to shard
  ``crc32(key) % K`` (:func:`shard_of`, stable across processes and runs), so no shard sees every trajectory.
* **Coordinator and lease authority.** One :class:`CoordinatorHost` actor holds the service's
  :class:`~rbpipe.service.coordinator.Coordinator` (work units, rate-limit band, learner progress), grants every
  lease and holds the latest weights' object ref. A lease is granted there and *adopted* by every shard (each keeps a
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

Modules, by job: :mod:`~rbpipe.service.ray.session` (start or join Ray, loopback),
:mod:`~rbpipe.service.ray.shards` (registry shards and their router), :mod:`~rbpipe.service.ray.coordinator`
(coordinator actor, weights, ``RayManager``), :mod:`~rbpipe.service.ray.actors` (worker actors for the
launcher's supervisor), :mod:`~rbpipe.service.ray.common` (names, Ray imported lazily, errors, proxies).
"""

from __future__ import annotations

from rbpipe.service.ray.actors import RayContext, RayProcess, parse_resources
from rbpipe.service.ray.common import COORDINATOR_NAME, SHARD_PREFIX
from rbpipe.service.ray.coordinator import (
           CoordinatorHost,
           CoordinatorProxy,
           RayManager,
           RayWeights,
           remove_session_logs,
           shard_log_dir,
)
from rbpipe.service.ray.session import LOOPBACK_ENV, RaySession, use_loopback
from rbpipe.service.ray.shards import (
           LOGGED,
           ShardedRegistry,
           ShardHost,
           shard_of,
)
from rbpipe.timing import NOTIFY_S, RESTART_WAIT_S
from rbpipe.timing import RAY_STATS_CACHE_S as STATS_CACHE_S

__all__ = [
           "COORDINATOR_NAME",
           "LOGGED",
           "LOOPBACK_ENV",
           "NOTIFY_S",
           "RESTART_WAIT_S",
           "SHARD_PREFIX",
           "STATS_CACHE_S",
           "CoordinatorHost",
           "CoordinatorProxy",
           "RayContext",
           "RayManager",
           "RayProcess",
           "RaySession",
           "RayWeights",
           "ShardHost",
           "ShardedRegistry",
           "parse_resources",
           "remove_session_logs",
           "shard_log_dir",
           "shard_of",
           "use_loopback",
]
