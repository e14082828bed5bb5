"""Workers' side of a service: :func:`connect` for collectors, :func:`connect_learner` for the learner.

``rbpipe collector --connect`` and ``rbpipe learner --connect`` are thin loops over these two objects, and
so are the processes ``rbpipe run`` spawns: a user's own collector loop or learner uses exactly the code the
built-in ones do. Everything is attached through the service's ``endpoint.json`` (or ``HOST:PORT`` plus a
key): the grouping registry (whole groups across writers), the coordinator (which prompts to generate, the
rate limit, counters), the store and the weights.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rbpipe.config import RunConfig
from rbpipe.errors import BadTrajectoryError, ConfigError, RbpipeError, StoreError
from rbpipe.grouping.manager import call
from rbpipe.model.task_spec import normalize_spec
from rbpipe.rate_limit import RateLimiter
from rbpipe.rundir import RATE_LIMIT, STAGING
from rbpipe.service.endpoint import REGISTRY_NAME, Attachment, attach
from rbpipe.service.weights import SharedWeights
from rbpipe.trajectory import GROUP_KEY, RAGGED_KEYS

if TYPE_CHECKING:
    from rbpipe.service.ray import RayWeights


def check_store_path(store: Path) -> None:
    if store.exists() and not store.is_dir():
        raise StoreError(f"--store {store} is a file, not a store directory: pass a new or existing "
                         "store directory (rbpipe creates it)")


def open_run_store(cfg: RunConfig, store: Path):
    """The run's store (created if new) with the trajectory schema's ragged keys and group key."""
    from rbpipe.storage import ArrowStorage, ZarrStorage

    check_store_path(store)
    cls = ArrowStorage if cfg.backend == "arrow" else ZarrStorage
    return cls(store, ragged_keys=RAGGED_KEYS, group_key=GROUP_KEY)


def _check_same(what: str, mine: str | None, theirs: str | None, target: str) -> None:
    if mine is not None and mine != theirs:
        raise ConfigError(f"--{what} {mine} differs from the service's ({theirs}): every process of a run uses "
                          f"the service's {what}; drop --{what}, or start a service with it "
                          f"(rbpipe serve --{what} {mine})")


def _rejected(err: BadTrajectoryError, n: int, indices: list[int] | None = None) -> BadTrajectoryError:
    # how many trajectories of the call were not handed over, and which (positions in the call; None: all)
    err.rejected = n  # type: ignore[attr-defined]
    err.rejected_indices = indices  # type: ignore[attr-defined]
    return err


class _Attached:
    """What collectors and the learner share: the attachment, the run's config, the weights, the stop flag."""

    def __init__(self, target: str | Path, authkey_file: str | None, task: str | None, model: str | None) -> None:
        self.attachment: Attachment = attach(target, authkey_file)
        self.config = self.attachment.config()
        _check_same("task", None if task is None else normalize_spec(task), self.config.task, str(target))
        _check_same("model", None if model is None else str(Path(model).resolve()),
                    None if self.config.model is None else str(Path(self.config.model).resolve()), str(target))
        spec = self.attachment.endpoint["weights"]
        if spec.get("engine") == "ray":
            from rbpipe.service.ray import RayWeights

            self._weights: SharedWeights | RayWeights = RayWeights(self.attachment.manager.coordinator_actor,
                                                                   spec["numel"])
        else:
            self._weights = SharedWeights(spec["path"], spec["numel"])
        self.coordinator = self.attachment.coordinator
        self._stop_checked, self._stop = 0.0, False

    @property
    def run_dir(self) -> Path:
        return self.attachment.run_dir

    @property
    def store(self) -> Path:
        return self.attachment.store

    @property
    def weights_version(self) -> int:
        return self._weights.version

    def load_weights(self, model: torch.nn.Module) -> int:
        """Copy the latest published policy into ``model``; returns its version."""
        return self._weights.load_into(model)

    def is_set(self) -> bool:
        """True once the service asked its workers to finish (checked at most every 0.2 s; an event-like API
        so that waits which take a ``stop_event`` can take this object)."""
        now = time.monotonic()
        if not self._stop and now - self._stop_checked > 0.2:
            self._stop_checked = now
            self._stop = bool(self._call("stop_requested"))
        return self._stop

    stop_requested = is_set

    def _call(self, method: str, *args: Any) -> Any:
        """A coordinator call; a service that went away is :class:`~rbpipe.errors.ManagerDiedError` (one line)."""
        return call(self.coordinator, method, *args)


class CollectorClient(_Attached):
    """A collector attached to a service: take work units, hand trajectories over, read the weights.

    Args:
        target: the service's run directory (``endpoint.json``), or ``HOST:PORT`` with the key in
            ``RBPIPE_AUTHKEY`` / ``authkey_file``.
        collector_id: this collector's id in the stored data (default: the next free one).
        task, model: only to check that they are the service's (a mismatch is a one-line error).

    Example (with ``rbpipe serve --run-dir runs/shared`` running; ``examples/custom_collector.py`` in full)::

        with rbpipe.connect("runs/shared") as client:
            unit = client.take()  # {"prompt": 12, "samples": 4}, or None while the rate limit holds back
            ...                   # generate unit["samples"] responses to task.prompt(unit["prompt"])
            client.extend(trajectory)  # each one, built with rbpipe.trajectory.make_trajectory
    """

    def __init__(self, target: str | Path, *, authkey_file: str | None = None, collector_id: int | None = None,
                 task: str | None = None, model: str | None = None) -> None:
        super().__init__(target, authkey_file, task, model)
        from rbpipe.buffer import make_replay_buffer

        cfg = self.config
        self.storage = open_run_store(cfg, self.store)
        self.buffer = make_replay_buffer(self.storage, manager=self.attachment.manager,
                                         staging_dir=self.store / STAGING, name=REGISTRY_NAME,
                                         **cfg.grouping_kwargs())
        self._wanted_id = collector_id
        self._unreported_ns = {"generate_ns": 0, "handover_ns": 0}  # sent with the next count
        self._asks = 0  # numbers each take and count: one that Ray runs twice (a resubmission) acts once
        self._join()
        self._model: torch.nn.Module | None = None

    def _join(self) -> None:
        self.lease = self.buffer.grouping_transform.lease_token()
        self.collector_id = int(self._call("join", self.lease, self._wanted_id))
        self._wanted_id = self.collector_id

    def take(self) -> dict | None:
        """The next work unit ``{"prompt": index, "samples": n}``, or None while the rate limit holds new
        prompts back (ask again shortly)."""
        units = self.take_many(1)
        return units[0] if units else None

    def take_many(self, max_units: int, wait_s: float = 0.0) -> list[dict]:
        """Up to ``max_units`` work units of different prompts in one round trip (generate them in one batch,
        hand them over in one :meth:`extend`); ``[]`` while the rate limit holds new prompts back.

        ``wait_s``: while it does, wait up to this long (0.2 s at most) for prompts to open before returning
        ``[]``: the service (either engine) answers the moment the learner moves the band."""
        units = self._take_many(max_units, wait_s)
        if isinstance(units, dict):  # {"lease": "expired"}: frozen past the lease's time to live
            # drop the expired lease first: its heartbeat may not have noticed yet, and re-joining under the same
            # token would be refused again (on Ray a shard restart can hold renewals up past the time to live)
            self.buffer.grouping_transform.close()
            self._join()
            units = self._take_many(max_units, wait_s)
            if isinstance(units, dict):
                raise RbpipeError("the service no longer knows this collector's lease; restart the collector")
        return units

    def _take_many(self, max_units: int, wait_s: float) -> list[dict] | dict:
        self._asks += 1
        return self._call("take_many", self.lease, max_units, wait_s, self._asks)

    def extend(self, trajectories) -> None:
        """Hand trajectories over: one (a [T] TensorDict), a [B, T] batch, or a list (e.g. a work unit's
        responses, of any lengths) in one round trip, validated exactly as ``rbpipe run``'s collectors are.

        Raises :class:`~rbpipe.errors.BadTrajectoryError` (one line) on bad input: the bad trajectories are
        counted as rejected and nothing of them was handed over; the good ones of the same call were
        (``err.rejected`` says how many were not, ``err.rejected_indices`` which: positions in the call, None
        when none of the call was handed over)."""
        transform = self.buffer.grouping_transform
        try:
            trajs = transform.split_trajectories(trajectories)
        except BadTrajectoryError as err:
            n = len(trajectories) if isinstance(trajectories, list) else 1
            self._count(n, rejected=n)
            raise _rejected(err, n) from None
        self._count(len(trajs))
        start = time.perf_counter_ns()
        try:
            self.buffer.extend(trajs)  # all or nothing: validated before any is staged
        except BadTrajectoryError as err:
            if len(trajs) == 1:
                self._numbered_count(0, 1)
                raise _rejected(err, 1, [0]) from None
            self._extend_each(trajs)  # isolate the bad ones; the good ones are still handed over
        finally:
            self._unreported_ns["handover_ns"] += time.perf_counter_ns() - start

    def _extend_each(self, trajs: list) -> None:
        errors, bad = [], []
        for i, traj in enumerate(trajs):
            try:
                self.buffer.extend(traj)
            except BadTrajectoryError as err:
                errors.append(err)
                bad.append(i)
        self._numbered_count(0, len(errors))
        if errors:
            raise _rejected(BadTrajectoryError(f"{len(errors)} of {len(trajs)} trajectories rejected: {errors[0]}"),
                            len(errors), bad)

    def _count(self, produced: int, rejected: int = 0) -> None:
        """Count trajectories as produced *before* handing them over, with the time spent since the last count:
        a collector killed in between loses at most this call (the summary's ``lost_in_flight``)."""
        pending, self._unreported_ns = self._unreported_ns, {"generate_ns": 0, "handover_ns": 0}
        self._numbered_count(produced, rejected, pending["generate_ns"], pending["handover_ns"])

    def _numbered_count(self, produced: int, rejected: int, generate_ns: int = 0, handover_ns: int = 0,
                        reasons: dict | None = None) -> None:
        self._asks += 1  # numbered as takes are: a count Ray runs twice is counted once
        self._call("count", produced, rejected, generate_ns, handover_ns, reasons, self.lease, self._asks)

    def add_generate_time(self, ns: int) -> None:
        """Time spent generating (reported with the next hand-over; the service sums it for the summary)."""
        self._unreported_ns["generate_ns"] += int(ns)

    def drop(self, reasons: dict[str, int]) -> None:
        """Samples generated but never handed over, ``{reason: n}`` (a reward that raised or timed out, a prompt
        too long): counted as produced and rejected, so the summary's conservation includes them, and summed by
        reason in its ``rejected_reasons``."""
        n = sum(int(v) for v in reasons.values())
        if n:
            self._numbered_count(n, n, 0, 0, {str(k): int(v) for k, v in reasons.items()})

    def skip(self, prompt: int, n: int = 1) -> None:
        """``n`` samples of the current unit of ``prompt`` that will not be handed over (rejected)."""
        self._call("skip", self.lease, prompt, n)

    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, state_dict)`` of the latest published policy (the run's model architecture)."""
        model = self._model
        if model is None:
            model = self._model = self.config.make_model()
        version = self.load_weights(model)
        return version, model.state_dict()

    def close(self) -> None:
        """Leave: what this collector still owed goes back to the others at once; its segment is sealed."""
        try:
            self._call("release", self.lease)
        except Exception:  # noqa: BLE001 - the service is gone: nothing to hand back
            pass
        self.buffer.grouping_transform.close()
        self.storage.close()

    def __enter__(self) -> CollectorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LearnerClient(_Attached):
    """The service's one learner: sample whole fresh groups from the store, publish weights, report progress.

    Args:
        target: as for :class:`CollectorClient`.
        task, model: only checked against the service's.
        wait_for_role: this learner replaces one that died: wait (up to two lease times to live) for the dead
            one's lease to expire rather than being refused the role at once.

    Example (``workers/learner.py`` is the whole loop)::

        client = rbpipe.connect_learner("runs/shared")
        rows = ReplayBuffer(storage=client.storage, sampler=FreshGroupSampler(num_groups=8), ...).sample()
        ...                       # the loss, backward, optimizer step
        client.publish(model, version=step)
        client.report(step=step)
    """

    def __init__(self, target: str | Path, *, authkey_file: str | None = None, task: str | None = None,
                 model: str | None = None, wait_for_role: bool = False) -> None:
        super().__init__(target, authkey_file, task, model)
        from rbpipe.grouping.lease_client import ProcessLease

        self._lease = ProcessLease(self.attachment.registry)
        self.lease = self._lease.token_now()
        problem = self._call("claim_learner", self.lease)
        if problem and wait_for_role:  # a learner that replaces a dead one (a learner actor restarted by Ray):
            # the dead one's lease, no longer renewed, holds the role until it expires (one time to live)
            deadline = time.monotonic() + 2 * float(call(self.attachment.registry, "lease_ttl")) + 1.0
            while problem and time.monotonic() < deadline:
                time.sleep(0.2)
                problem = self._call("claim_learner", self.lease)
        if problem:
            self._lease.release()
            raise RbpipeError(problem)
        self.storage = open_run_store(self.config, self.store)
        self.limiter = RateLimiter.for_run(self.config, self.run_dir / RATE_LIMIT, create=False)
        self._lock = threading.Lock()

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Publish ``model`` as policy ``version`` (collectors pick it up before their next prompt)."""
        self._weights.publish(model, version=version, learner_step=version)

    def collectors_timing(self) -> dict[str, float]:
        """Collectors' seconds so far (all together): generating, handing over, blocked by the rate limit."""
        return self._call("timing")

    def report(self, **fields: Any) -> dict[str, float]:
        """Progress for the service's line, band and summary (``rbpipe.service.coordinator.LEARNER_FIELDS``); returns
        :meth:`collectors_timing` (a learner reports every step and logs both: one round trip)."""
        return call(self.coordinator, "report_learner", **fields)

    def close(self) -> None:
        try:
            self._call("release", self.lease)
        except Exception:  # noqa: BLE001 - the service is gone
            pass
        self._lease.release()
        self.storage.close()


def connect(target: str | Path, **kwargs: Any) -> CollectorClient:
    """Attach a collector (your own loop) to a running service: ``with rbpipe.connect(RUN_DIR) as w: ...``."""
    return CollectorClient(target, **kwargs)


def connect_learner(target: str | Path, **kwargs: Any) -> LearnerClient:
    """Attach the learner to a running service (see :func:`rbpipe.workers.learner.run_learner` for the loop)."""
    return LearnerClient(target, **kwargs)
