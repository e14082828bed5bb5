"""``Service``: a run's shared state without its workers — what ``rbpipe serve`` runs and ``rbpipe run`` wraps.

The service holds the store's writer lock and starts the grouping manager (registry + coordinator), publishes
the policy's weights, and writes ``RUN_DIR/endpoint.json`` and the key (``RUN_DIR/authkey``, mode 0600).
Collectors and the learner attach to it through that file (:func:`rbpipe.service.endpoint.attach`), whether
``rbpipe run`` spawned them or a user started them from another shell: both paths run the same code.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rbpipe.buffer import make_replay_buffer
from rbpipe.config import RunConfig
from rbpipe.errors import ManagerDiedError
from rbpipe.rate_limit import RateLimiter
from rbpipe.rundir import AUTHKEY, ENDPOINT, METRICS, RATE_LIMIT, STAGING
from rbpipe.sampling.staleness import unit_size
from rbpipe.service.endpoint import REGISTRY_NAME, new_authkey, write_endpoint
from rbpipe.service.engine import open_engine
from rbpipe.service.host import open_coordinator
from rbpipe.tracking.checkpoint import load_checkpoint
from rbpipe.tracking.metrics_log import truncate_metrics

if TYPE_CHECKING:
    from rbpipe.buffer import GroupReplayBuffer
    from rbpipe.service.engine import Weights
    from rbpipe.service.host import ServiceHost


def coordinator_settings(cfg: RunConfig, run_dir: Path, expect_collectors: int = 1) -> dict[str, Any]:
    """How the coordinator shares prompts out: units of one collector's share (``rbpipe run``'s split),
    within the run's rate-limit band."""
    return {"samples_per_prompt": cfg.samples_per_prompt, "unit_size": unit_size(cfg),
            "limiter": RateLimiter.settings_for_run(cfg), "state_dir": str(run_dir),
            "expect_collectors": expect_collectors}


class Service:
    """The shared state of one run (store lock held by the caller).

    Args:
        cfg: the run's configuration (what attached workers build their task, model and loss from).
        run_dir: the run directory (endpoint, key, checkpoint, metrics, prompts).
        store: the store directory; ``storage``: the open store on it.
        listen: ``(host, port)`` to listen on TCP (port 0: any free port); None: a private Unix socket.
        expect_collectors: no prompt opens before this many collectors joined (``rbpipe run``: all of them).

    Started by :func:`rbpipe.workers.launcher.serve` (``rbpipe serve``) and
    :func:`rbpipe.workers.launcher.launch` (``rbpipe run``), which hold the store's writer lock around it.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, store: Path, storage, *,
                 listen: tuple[str, int] | None = None, expect_collectors: int = 1, engine: str = "local",
                 grouping_shards: int = 1) -> None:
        self.cfg, self.run_dir, self.store, self.storage = cfg, Path(run_dir), Path(store), storage
        self.listen = listen
        self.engine, self.grouping_shards = engine, int(grouping_shards)
        self._engine = open_engine(engine)
        self.expect_collectors = expect_collectors
        self.manager: ServiceHost | None = None
        self.buffer: GroupReplayBuffer | None = None
        self.coordinator: Any = None  # the coordinator's proxy (a Ray actor handle with engine="ray")
        self.weights: Weights | None = None
        self.requeued = self.torn = 0
        self.rows_at_start = 0

    def start(self, log=print) -> None:
        """Start the manager, registry and coordinator; requeue what a stopped session had staged; publish
        the policy (from the checkpoint when resuming); then write ``endpoint.json``."""
        cfg = self.cfg
        checkpoint = load_checkpoint(self.run_dir)  # a bad one is refused before anything starts
        key = new_authkey(self.run_dir)
        self.manager = self._engine.start(self.run_dir, listen=self.listen, authkey=key,
                                          shards=self.grouping_shards, log=log)
        self.buffer = make_replay_buffer(self.storage, manager=self.manager, staging_dir=self.store / STAGING,
                                         name=REGISTRY_NAME, **cfg.grouping_kwargs())
        self.rows_at_start = len(self.storage)
        self.requeued, self.torn, staged = self.buffer.requeue_staged()  # queued again, not lost
        if self.requeued or self.torn:
            log(f"resumed {self.requeued} pending trajectories from the staging area"
                + (f"; {self.torn} torn staging file(s) set aside" if self.torn else ""))
        self.coordinator = open_coordinator(self.manager, REGISTRY_NAME,
                                            coordinator_settings(cfg, self.run_dir, self.expect_collectors))
        if staged:  # handed over by the last session, if maybe not yet recorded as such: not owed again
            self.coordinator.reconcile_staged(staged)
        model = cfg.make_model()
        numel = sum(p.numel() for p in model.parameters())
        self.weights, weights_spec = self._engine.weights(self.manager, self.run_dir, numel)
        version = 0
        if checkpoint is not None:  # collectors start from the checkpoint's policy *and* its version number, or
            model.load_state_dict(checkpoint["model"])  # their first groups look older than the resumed learner
            version = int(checkpoint["step"])           # and are retired as stale
        truncate_metrics(self.run_dir / METRICS, version)  # steps past the checkpoint are trained again
        self.weights.publish(model, version=version, learner_step=version)
        self.coordinator.report_learner(step=version, done=0, phase=0)
        address = self.manager.address
        endpoint = {"address": list(address) if isinstance(address, tuple) else address,
                    "authkey_file": str(self.run_dir / AUTHKEY), "registry": REGISTRY_NAME,
                    "store": str(self.store), "run_dir": str(self.run_dir.resolve()),
                    "weights": weights_spec, "config": cfg.to_json(), "pid": os.getpid(), "engine": self.engine}
        endpoint.update(self._engine.endpoint_fields(self.manager))
        self.coordinator.set_endpoint(endpoint)
        write_endpoint(self.run_dir, endpoint)

    def host_pids(self) -> dict[str, int]:
        """The pids of the processes that host the service beyond its manager (Ray: its actors)."""
        return self._engine.host_pids(self.manager) if self.manager is not None else {}

    def status(self) -> dict[str, Any]:
        """The coordinator's figures plus the grouping counters (:class:`ManagerDiedError` if it is gone)."""
        try:
            status = dict(self.coordinator.status())
            assert self.buffer is not None  # (started)
            status["grouping"] = dict(self.buffer.grouping_transform.get_stats())
        except ManagerDiedError:
            raise
        except Exception as err:  # noqa: BLE001 - a connection error of the proxy
            raise ManagerDiedError(f"the shared-state manager stopped answering ({err}); the run cannot "
                                   f"continue. Resume it with: rbpipe run --resume {self.run_dir}") from err
        return status

    def request_stop(self) -> None:
        try:
            self.coordinator.request_stop()
        except Exception:  # noqa: BLE001 - the manager is gone: its workers stop on their own
            pass

    def wait_for_workers(self, timeout: float = 15.0) -> None:
        """After :meth:`request_stop`: give attached workers up to ``timeout`` to finish their unit and leave
        (a collector killed meanwhile is waited for until its lease expires, at most ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                status = self.coordinator.status()
            except Exception:  # noqa: BLE001 - the manager is gone: nobody left to wait for
                return
            if not status["collectors"] and not status["learner_attached"]:
                return
            time.sleep(0.1)

    def confirm_stored(self) -> int:
        """Once the workers are gone: confirm the groups a killed writer stored but had not confirmed (else the
        summary would count them as stored and as queued). Returns how many; 0 if the manager is gone."""
        try:
            return self.buffer.confirm_stored() if self.buffer is not None else 0
        except Exception:  # noqa: BLE001 - the manager is gone: the summary says what the store holds
            return 0

    def close(self) -> None:
        """Stop answering: the endpoint and key go first (a late worker gets a clear 'no service' error), then
        the manager, the weights and the band."""
        for name in (ENDPOINT, AUTHKEY):
            (self.run_dir / name).unlink(missing_ok=True)
        if self.manager is not None:
            with contextlib.suppress(Exception):  # the manager is gone: its last save is in the journal
                self.coordinator.close()  # the final share-out and counters, in prompts.json alone
            try:
                self.manager.shutdown()
            except Exception:  # noqa: BLE001 - already gone
                pass
            self._engine.remove_logs(self.manager, self.run_dir)
        if self.weights is not None:
            self.weights.unlink()
        (self.run_dir / RATE_LIMIT).unlink(missing_ok=True)
