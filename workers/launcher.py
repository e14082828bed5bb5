"""Launcher and supervisor: ``rbpipe run`` (a service plus its collectors and learner) and ``rbpipe serve``
(the service alone, for workers that attach from elsewhere); both watch the run and write its summary.

Start method: ``multiprocess``'s **fork server** (:func:`rbpipe.system.procs.worker_context`). A plain fork would
copy a parent that already ran multi-threaded torch ops (a child can then hang in OpenMP while holding a write
lock) and share lazily-allocated storages by accident; the fork server only imported the heavy modules, so
each worker starts clean without importing them again, and every shared object travels explicitly (manager
proxies, paths of memory-mapped files and of the store). docs/DESIGN.md says why and what it saves.

Size (over 500 lines): opening a run, the run itself, its supervision and its summary share the ``Worker`` records
and the stop request; where workers run is :mod:`rbpipe.workers.sites`, the service is ``workers/serve.py``.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rbpipe.config import RunConfig
from rbpipe.errors import ConfigError, ManagerDiedError, RbpipeError
from rbpipe.model.task_spec import check_task_fits
from rbpipe.rundir import CONFIG, METRICS, PID_STARTS, PIDS, PLOT, RUN, STORE, SUMMARY
from rbpipe.service.clients import check_store_path, open_run_store
from rbpipe.service.engine import ENGINES, LOCAL
from rbpipe.storage import StoreLock
from rbpipe.storage.catalog import repair_catalog
from rbpipe.system.fsutil import atomic_write_json
from rbpipe.system.procs import quiet_killed_worker_trackers, same_process_alive, start_time, worker_context
from rbpipe.timing import STALL_REPORT_S, STOP_GRACE_S, SUPERVISE_POLL_S, TERM_GRACE_S
from rbpipe.tracking.checkpoint import load_checkpoint
from rbpipe.tracking.memory import record_peak, session_peaks
from rbpipe.tracking.progress import LEARNER_READY, STARTING, phase, postfix, progress_bar
from rbpipe.tracking.progress import SUMMARY as WRITING_SUMMARY
from rbpipe.tracking.report import (
    MetricsTail,
    first_last_fraction,
    last_mean,
    plot_rewards,
    read_metrics,
    summary_table,
    timing_summary,
)
from rbpipe.workers.collector import collector_entry
from rbpipe.workers.learner import learner_entry
from rbpipe.workers.serve import Service
from rbpipe.workers.sites import WorkerSite, open_site


@dataclass
class Worker:
    name: str
    target: Any
    args: tuple
    process: Any = None
    restarts: int = 0
    next_start: float = 0.0
    exits: list[str] = field(default_factory=list)


def exit_cause(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return "exited normally" if exitcode == 0 else f"exited with code {exitcode}"


def new_run_dir(root: Path = Path("runs")) -> Path:
    """A fresh run directory name (created later, once every input has been checked)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return root / f"{stamp}-{uuid.uuid4().hex[:6]}"


def check_group_size(storage, cfg: RunConfig, store: Path) -> None:
    """One store holds groups of one size: a run with another ``--grpo-size`` would mix them."""
    if not len(storage):
        return
    spans = storage.group_spans()
    sizes = sorted({int(b - a) for _, a, b in spans.tolist()})
    if sizes and sizes != [cfg.grpo_size]:
        raise ConfigError(f"store {store} holds groups of {'/'.join(map(str, sizes))} trajectories; this run "
                          f"would add groups of --grpo-size {cfg.grpo_size} to them: pass --grpo-size "
                          f"{sizes[0]} or a new --store/--run-dir")


def runs_alive(run_dir: Path) -> dict[str, int]:
    """Processes recorded in ``RUN_DIR/pids.json`` that still run (same pid *and* start time)."""
    try:
        pids = json.loads((run_dir / PIDS).read_text())
    except (OSError, ValueError):
        return {}
    try:
        starts = json.loads((run_dir / PID_STARTS).read_text())
    except (OSError, ValueError):
        starts = {}
    return {name: pid for name, pid in pids.items()
            if isinstance(pid, int) and pid > 0 and same_process_alive(pid, starts.get(name))
            and (name in starts or _is_python(pid))}


def _is_python(pid: int) -> bool:
    """For pids recorded without a start time (older runs): a recycled pid rarely runs Python."""
    try:
        return b"python" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True


def refuse_if_running(run_dir: Path) -> None:
    """A resume must never share a store with processes of the run it continues."""
    live = runs_alive(run_dir)
    if live:
        names = ", ".join(f"{name} pid {pid}" for name, pid in live.items())
        raise RbpipeError(f"run {run_dir} is still running ({names}): stop it first (kill "
                          f"{live.get('launcher', next(iter(live.values())))}) or wait for it to end, then resume")


def _prepare_resume(run_dir: Path, steps: int | None) -> tuple[RunConfig, Path]:
    """The saved configuration and store of ``run_dir``, after checking that none of its processes lives."""
    if not (run_dir / CONFIG).exists():
        raise RbpipeError(f"--resume {run_dir}: no {CONFIG} there; pass the run directory printed by a "
                          "previous `rbpipe run`")
    refuse_if_running(run_dir)
    load_checkpoint(run_dir)  # one that is not tensors and plain values is refused here, before anything is touched
    cfg = RunConfig.from_json(json.loads((run_dir / CONFIG).read_text()))
    if steps is not None:
        cfg.steps = steps  # extend (or shorten) the resumed run; saved once the store is ours
    return cfg, Path(json.loads((run_dir / RUN).read_text())["store"])


def _prepare_new(run_dir: Path | None, store: Path | None) -> tuple[Path, Path]:
    """Where a new run goes; refuses a run directory that already holds a run (``--resume`` continues one)."""
    run_dir = Path(run_dir) if run_dir is not None else new_run_dir()
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file: pass a new directory")
    if (run_dir / CONFIG).exists():
        raise ConfigError(f"--run-dir {run_dir} already holds a run: continue it with `rbpipe run --resume "
                          f"{run_dir}`, or pass a new --run-dir")
    store = Path(store) if store is not None else run_dir / STORE
    check_store_path(store)
    return run_dir, store


class StopRequest:
    """SIGINT and SIGTERM of the launcher: the first one stops the run as Ctrl-C does (workers stop, the
    summary is written, the writer lock released); later ones only hurry the shutdown (workers are terminated
    instead of waited for) and never skip the summary or the lock. The handler raises nothing, so no cleanup
    step can be cut in half."""

    def __init__(self) -> None:
        self.signals: list[str] = []
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set there; a library caller in a thread keeps its own
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum, frame) -> None:
        self.signals.append(signal.Signals(signum).name)

    @property
    def requested(self) -> bool:
        return bool(self.signals)

    @property
    def hurry(self) -> bool:
        return len(self.signals) > 1

    @property
    def kill_now(self) -> bool:
        """A third signal: workers still running are killed without waiting for them."""
        return len(self.signals) > 2

    def check(self) -> None:
        """Between start-up steps: stop now if asked to."""
        if self.signals:
            raise _Interrupted()


class _Interrupted(Exception):
    """Start-up was interrupted by :class:`StopRequest` (never escapes :func:`launch`)."""


def check_task_and_model(cfg: RunConfig, *, local_devices: bool = True) -> None:
    """Build the task and load the model (and its tokenizer) once, as every worker will, so that a bad
    ``--task`` or ``--model`` (or, with ``local_devices``, a ``--device`` this machine lacks) is a one-line error
    before any process starts or any file is written."""
    if local_devices:
        cfg.check_devices()
    model, tokenizer = cfg.make_model_and_tokenizer()
    check_task_fits(cfg.make_task(), cfg.task, model, cfg.max_new_tokens, tokenizer=tokenizer,
                    chat_template=cfg.chat_template, label=cfg.task_label)


def resume_hint(run_dir: Path) -> str:
    return f"resume it with: rbpipe run --resume {run_dir}"


def launch(cfg: RunConfig | None = None, *, run_dir: Path | None = None, store: Path | None = None,
           resume: Path | None = None, steps: int | None = None, progress: bool = True,
           log=print, engine: str = "local", ray: dict | None = None) -> dict[str, Any]:
    """Run a whole pipeline and return the summary (also written to ``RUN_DIR/summary.json``).

    Every input is checked before anything is written; SIGINT and SIGTERM stop the run cleanly
    (:class:`StopRequest`) and every worker dies with the launcher, however it ends.

    ``engine="ray"`` runs the grouping shards, the coordinator, the collectors and the learner as Ray actors
    (:mod:`rbpipe.service.ray`); ``ray``: ``{"address": ADDR or None (a private loopback instance),
    "grouping_shards": K, "num_cpus": per worker, "resources": {"learner": {...}, "collectors": [...]}}``.
    """
    return _open_and_run(cfg, run_dir=run_dir, store=store, resume=resume, steps=steps, progress=progress,
                         log=log, spawn_workers=True, engine=engine, ray=ray)


def serve(cfg: RunConfig | None = None, *, run_dir: Path | None = None, store: Path | None = None,
          resume: Path | None = None, steps: int | None = None, listen: tuple[str, int] | None = None,
          progress: bool = True, log=print, engine: str = "local", ray: dict | None = None) -> dict[str, Any]:
    """``rbpipe serve``: the service alone, until SIGINT/SIGTERM or until the attached learner is done; then
    the summary (the same fields as :func:`launch`). ``listen``: TCP ``(host, port)`` instead of a Unix socket."""
    return _open_and_run(cfg, run_dir=run_dir, store=store, resume=resume, steps=steps, progress=progress,
                         log=log, spawn_workers=False, listen=listen, engine=engine, ray=ray)


def _open_and_run(cfg: RunConfig | None, *, run_dir, store, resume, steps, progress: bool, log,
                  spawn_workers: bool, listen=None, engine: str = "local", ray: dict | None = None) -> dict[str, Any]:
    if engine not in ENGINES:
        raise ConfigError(f"--engine {engine!r}: expected {' or '.join(repr(name) for name in ENGINES)}")
    if engine == LOCAL and ray:
        raise ConfigError("--ray-address, --grouping-shards and the other --ray-* options need --engine ray")
    with StopRequest() as stop_request:  # from here on, Ctrl-C/SIGTERM never cut a step in half
        if resume is not None:
            run_dir = Path(resume)
            cfg, store = _prepare_resume(run_dir, steps)
        else:
            cfg = cfg or RunConfig()
            run_dir, store = _prepare_new(run_dir, store)
        if cfg.grouping != "rbpipe":
            raise ConfigError(f"--grouping {cfg.grouping}: a run's collectors and learner attach to rbpipe's shared "
                              "grouping service; torchrl's stock MCAdvantage is the baseline of "
                              "`python bench/grouping.py` and `rbpipe stress --grouping torchrl`")
        check_task_and_model(cfg, local_devices=engine == LOCAL)  # before the run dir or the store is touched
        store = store.resolve()
        lock = StoreLock(store)
        lock.acquire()
        try:
            storage = open_run_store(cfg, store)
            check_group_size(storage, cfg, store)
            run_dir.mkdir(parents=True, exist_ok=True)
            run_dir = run_dir.resolve()
            if resume is None or steps is not None:
                cfg.save(run_dir / CONFIG)
            if resume is None:
                (run_dir / RUN).write_text(json.dumps({"store": str(store)}))
        except BaseException:
            lock.release()
            raise
        return _launch_locked(cfg, run_dir, store, storage, lock, resume is not None, stop_request,
                              progress=progress, log=log, listen=listen, spawn_workers=spawn_workers,
                              engine=engine, ray=ray or {})


def _launch_locked(cfg: RunConfig, run_dir: Path, store: Path, storage, lock: StoreLock, resumed: bool,
                   stop_request: StopRequest, *, progress: bool, log, listen=None,
                   spawn_workers: bool = True, engine: str = "local", ray: dict | None = None) -> dict[str, Any]:
    """The run itself, once the store's writer lock is held: a :class:`Service` plus (``rbpipe run``) the
    collectors and the learner, attached to it as any worker would be. Always releases the lock and writes
    the summary."""
    t0 = time.time()
    ray = ray or {}
    site = open_site(engine, cfg, ray)
    service = Service(cfg, run_dir, store, storage, listen=listen,
                      expect_collectors=cfg.collectors if spawn_workers else 1, engine=engine,
                      grouping_shards=int(ray.get("grouping_shards") or 1))
    workers: list[Worker] = []
    status = "interrupted"
    session_start = None
    try:
        stop_request.check()
        site.open()
        service.start(log=log)
        assert service.manager is not None  # (started)
        session_start = {"produced": 0, "rejected": 0, "rows": service.rows_at_start, "requeued": service.requeued,
                         "torn": service.torn}
        stop_request.check()
        pids = {"launcher": os.getpid(), "manager": _manager_pid(service.manager)}
        if spawn_workers:
            target = str(run_dir)
            workers.append(Worker("learner", learner_entry, (target,)))
            for cid in range(cfg.collectors):
                workers.append(Worker(f"collector {cid}", collector_entry, (target, cid)))
        else:
            log(f"serving {run_dir} (store {store}) at {_describe(service.manager.address)}: attach workers with "
                f"`rbpipe collector --connect {run_dir}` and `rbpipe learner --connect {run_dir}`; Ctrl-C stops")
        write_pids(run_dir, pids)
        pids.update(service.host_pids())
        for w in workers:
            _start(site.ctx, w, pids, run_dir)
        site.record(run_dir)
        status = _supervise(cfg, workers, service, run_dir, pids, stop_request, progress=progress, log=log,
                            site=site)
    except _Interrupted:
        pass
    except ManagerDiedError as err:  # a summary all the same: the store, the metrics and the checkpoint say enough
        log(str(err))
        status = ("interrupted" if workers else "stopped") if stop_request.requested else "manager died"
    finally:
        if stop_request.requested and status == "interrupted":
            log(f"interrupted ({stop_request.signals[0]}): stopping workers; {resume_hint(run_dir)}")
        service.request_stop()
        _stop_all(workers, hurry=lambda: stop_request.hurry, kill_now=lambda: stop_request.kill_now, log=log)
        if not workers and not stop_request.hurry:  # `rbpipe serve`: attached workers leave before it closes
            service.wait_for_workers()
        service.confirm_stored()
        final = _final_status(service)
        record_peak(run_dir, "manager", _manager_pid(service.manager))  # while it still runs
        service.close()
        try:
            repaired = repair_catalog(store)
            if repaired:
                log(f"catalogue: added {repaired} committed group(s) that a stopped writer had not listed yet")
        except RbpipeError as err:
            log(f"catalogue repair skipped: {err}")
        lock.release()
        site.close(run_dir)
    summary = _summarize(cfg, run_dir, store, storage, final, workers, t0, status, session_start)
    summary["engine"] = engine
    summary.update(site.summary_fields())
    (run_dir / SUMMARY).write_text(json.dumps(summary, indent=2, default=str))
    log(summary_table(summary))
    if status == "done" and cfg.target_reward is not None:
        log(f"the task is learned: mean reward {summary['reward_last10']:.3f} over the last 10 steps >= "
            f"{cfg.target_reward} at step {summary['learner_steps']}" if summary["reached_target"] else
            f"stopped at the step cap ({cfg.steps}) before the target: mean reward {summary['reward_last10'] or 0:.3f} "
            f"over the last 10 steps < {cfg.target_reward}")
    if status == "interrupted":
        log(f"run interrupted; {resume_hint(run_dir)}")
    return summary


def _describe(address) -> str:
    if isinstance(address, tuple):
        return f"{address[0]}:{address[1]}"
    return f"unix socket {address}" if str(address).startswith("/") else f"Ray cluster {address}"


def _start(ctx, w: Worker, pids: dict | None = None, run_dir: Path | None = None) -> None:
    w.process = ctx.Process(target=w.target, args=w.args, name=f"rbpipe {w.name}", daemon=True)
    with quiet_killed_worker_trackers():
        w.process.start()
    if pids is not None and run_dir is not None:
        pids[w.name] = w.process.pid
        write_pids(run_dir, pids)


def write_pids(run_dir: Path, pids: dict) -> None:
    """``RUN_DIR/pids.json``: who is running now (for operators, the fault tests and ``--resume``, which refuses
    while any of them lives), and their start times in ``pid_starts.json`` (written first)."""
    atomic_write_json(run_dir / PID_STARTS, {name: start_time(pid) for name, pid in pids.items() if pid})
    atomic_write_json(run_dir / PIDS, pids)


def _manager_pid(manager) -> int | None:
    process = getattr(manager, "_process", None)
    return getattr(process, "pid", None)


def _supervise(cfg: RunConfig, workers: list[Worker], service: Service, run_dir: Path, pids: dict,
               stop_request: StopRequest, *, progress: bool, log, site: WorkerSite | None = None) -> str:
    """Watch the service (and ``rbpipe run``'s workers) until the learner finishes or a stop is requested;
    restart dead collectors with back-off."""
    status = service.status()
    start_step = int(status["learner"]["step"])
    bar = progress_bar(total=cfg.steps, initial=start_step, desc=STARTING, unit="step", disable=not progress,
               dynamic_ncols=True)
    learner = workers[0] if workers else None
    tail = MetricsTail(run_dir / METRICS)
    last_t, last_written = time.time(), 0
    last_step, last_progress, stall_reported = start_step, time.time(), False
    try:
        while True:
            time.sleep(SUPERVISE_POLL_S)
            if stop_request.requested:  # first: a learner stopped by the same signal (a process group's) reports done
                return "interrupted" if workers else "stopped"
            try:
                status = service.status()
            except ManagerDiedError as err:  # the stop path still writes the summary, from the store and metrics
                if stop_request.requested:
                    return "interrupted" if workers else "stopped"
                log(f"{err}")
                return "manager died"
            learner_state = status["learner"]
            if learner_state["done"]:
                return "done"
            if learner is not None and hasattr(learner.process, "poll_restarts"):
                _note_learner_restarts(learner, pids, run_dir, site, cfg, log)
            if learner is not None and not learner.process.is_alive():
                if _final_status(service).get("learner", {}).get("done"):  # reported done, left between two checks
                    return "done"
                cause = exit_cause(learner.process.exitcode)
                log(f"learner {cause}; stopping the run ({resume_hint(run_dir)})")
                return f"learner {cause}"
            for w in workers[1:]:
                if w.process is not None and not w.process.is_alive():
                    cause = exit_cause(w.process.exitcode)
                    w.exits.append(cause)
                    w.process = None
                    if w.restarts >= cfg.max_restarts:
                        log(f"{w.name} {cause}; restart limit ({cfg.max_restarts}) reached, stopping the run")
                        return f"{w.name} {cause}"
                    delay = min(8.0, 0.5 * 2 ** w.restarts)
                    log(f"{w.name} {cause}; restarting in {delay:.1f}s ({w.restarts + 1}/{cfg.max_restarts})")
                    w.next_start = time.time() + delay
                    w.restarts += 1
                elif w.process is None and time.time() >= w.next_start:
                    _start(site.ctx if site is not None else worker_context(), w, pids, run_dir)
            step = int(learner_state["step"])
            bar.n = step
            bar.set_description(phase(int(learner_state["phase"]), step, start_step), refresh=False)
            record = tail.poll()
            stats = status["grouping"]
            now = time.time()
            if step != last_step:
                last_step, last_progress, stall_reported = step, now, False
            elif now - last_progress > STALL_REPORT_S and not stall_reported and status["learner_attached"]:
                log(_stall_report(status, now - last_progress))
                stall_reported = True
            written = int(stats.get("written_groups", 0)) * cfg.grpo_size
            rate = (written - last_written) / max(1e-6, now - last_t)
            last_t, last_written = now, written
            bar.set_postfix(postfix(record, stats, rate), refresh=False)
            bar.refresh()
    except KeyboardInterrupt:  # only where SIGINT keeps Python's default handler (launch() replaces it)
        return "interrupted"
    finally:  # what follows (stopping workers, the catalogue, the plot) takes seconds: say so
        try:
            bar.n = int(service.status()["learner"]["step"])
        except RbpipeError:
            pass
        if bar.n > start_step:  # steps that ran between two refreshes (a short run) are shown as training first
            bar.set_description(phase(LEARNER_READY, bar.n, start_step), refresh=False)
            bar.refresh()
        bar.set_description(WRITING_SUMMARY, refresh=False)
        bar.refresh()
        bar.close()


def _note_learner_restarts(learner: Worker, pids: dict, run_dir: Path, site: WorkerSite | None, cfg: RunConfig,
                           log) -> None:
    """``--engine ray``: Ray restarts the learner's actor itself, which resumes from the latest checkpoint; the
    run goes on. Note each restart (summary, ``pids.json``, ``ray_workers.json``)."""
    seen = learner.process.poll_restarts()
    if seen <= learner.restarts:
        return
    learner.exits.extend(["restarted by Ray"] * (seen - learner.restarts))
    learner.restarts = seen
    log(f"learner actor restarted by Ray ({seen}/{cfg.max_restarts}): it resumes from its last checkpoint")
    pids["learner"] = learner.process.pid
    write_pids(run_dir, pids)
    if site is not None:
        site.record(run_dir)


def _stall_report(status: dict, idle_s: float) -> str:
    """One line that says where a run without learner progress is waiting (printed once per stall)."""
    stats, learner = status["grouping"], status["learner"]
    return (f"no learner step for {idle_s:.0f}s (step {learner['step']}): {status['band']}; collectors attached "
            f"{sorted(status['collectors'])}, blocked by the band {status['insert_blocked_ns'] / 1e9:.0f}s in all, "
            f"learner waited {learner.get('sample_blocked_ns', 0) / 1e9:.0f}s for data; groups written "
            f"{stats.get('written_groups')}, dropped {stats.get('dropped_groups')}, trajectories queued "
            f"{stats.get('queued_trajectories')}")


def _stop_all(workers: list[Worker], timeout: float | None = None, hurry=lambda: False, kill_now=lambda: False,
              log=None, term_timeout: float | None = None) -> None:
    """Stop ``rbpipe run``'s workers (the service already asked them to finish), with waits that escalate:
    up to ``timeout`` (:data:`STOP_GRACE_S`) for them to leave on their own (the learner finishes its step and
    checkpoints; ``hurry()``, a second signal, skips this), then SIGTERM and up to ``term_timeout``
    (:data:`TERM_GRACE_S`) for those still running (the learner abandons its step and checkpoints the last
    finished one, a collector abandons its generation; ``kill_now()``, a third signal, cuts it short), then
    SIGKILL. Returns once every worker is gone, so that the manager they talk to is shut down only after them."""
    timeout = STOP_GRACE_S if timeout is None else timeout
    term_timeout = TERM_GRACE_S if term_timeout is None else term_timeout

    def alive() -> list[Worker]:
        return [w for w in workers if w.process is not None and w.process.is_alive()]

    def wait(seconds: float, cut_short) -> None:
        deadline = time.monotonic() + seconds
        while alive() and time.monotonic() < deadline and not cut_short():
            time.sleep(0.05)

    wait(timeout, lambda: hurry() or kill_now())
    late = alive()
    if late:
        if log is not None:
            log(f"{', '.join(w.name for w in late)} still running: SIGTERM (the learner abandons its step and "
                "writes its checkpoint, a collector its generation)")
        for w in late:
            w.process.terminate()
        wait(term_timeout, kill_now)
    late = alive()
    if late and log is not None:
        log(f"{', '.join(w.name for w in late)} still running: SIGKILL")
    for w in late:
        w.process.kill()
    for w in late:
        w.process.join(timeout=10)
    for w in workers:  # how each ended, for the summary (a collector killed mid-hand-over may lose that call)
        if w.process is not None and w.process.exitcode not in (0, None):
            w.exits.append(exit_cause(w.process.exitcode))


def _final_status(service: Service) -> dict[str, Any]:
    try:
        return service.status()
    except Exception:  # noqa: BLE001 - manager gone: report what the store says
        return {}


def _summarize(cfg: RunConfig, run_dir: Path, store: Path, storage, final: dict, workers, t0: float,
               status: str, start: dict | None) -> dict[str, Any]:
    """Cumulative figures of the run, plus the exact per-session balance that ``conservation_ok`` checks.

    Per session: trajectories that reached the grouping transform (``handed_over``, including those
    requeued from the staging area at start) equal written + dropped + unselected + still queued. A collector killed
    while handing a call over (counted first; one work unit for rbpipe's collectors) may lose that call's
    trajectories, which never reached shared state: ``lost_in_flight <= kills * largest_handover``.
    """
    start = start or {"produced": 0, "rejected": 0, "rows": 0, "requeued": 0, "torn": 0}
    stats = final.get("grouping", {})
    records = read_metrics(run_dir / METRICS)
    rewards = [r["reward_mean"] for r in records]
    first, last = first_last_fraction(rewards)
    last10 = last_mean(rewards)
    plot = plot_rewards(records, run_dir / PLOT, title=f"rbpipe run ({cfg.loss.get('loss', 'grpo')}, lr={cfg.lr})")
    written = len(storage)
    groups_dropped = int(stats.get("dropped_groups", 0))
    dropped = groups_dropped * cfg.samples_per_prompt
    unselected = int(stats.get("unselected_trajectories", 0))
    queued = int(stats.get("queued_trajectories", 0))
    produced = final.get("produced_total")
    rejected = final.get("rejected_total", 0)
    handed_over = int(stats.get("completed_trajectories", 0))
    exits = sum(1 for w in workers[1:] for e in w.exits if e != "exited normally")
    kills = max(exits, int(final.get("lost_leases", 0)))
    session = {"produced": final.get("produced"), "rejected": final.get("rejected", 0),
               "requeued_at_start": start["requeued"],
               "torn_staging_files": start["torn"], "handed_over": handed_over,
               "written": written - start["rows"], "dropped": dropped, "unselected": unselected, "queued": queued,
               "largest_handover": int(final.get("largest_handover", 0))}
    # requeued trajectories went through the transform again, so they are part of handed_over
    session["lost_in_flight"] = (None if produced is None
                                 else session["produced"] - session["rejected"] - (handed_over - start["requeued"]))
    balanced = handed_over == session["written"] + dropped + unselected + queued
    summary = {
        "status": status,
        "produced": produced, "rejected": rejected, "rejected_reasons": final.get("rejected_reasons", {}),
        "written": written, "dropped": dropped,
        "unselected": unselected, "queued": queued,
        "groups_written": written // cfg.grpo_size, "groups_dropped": groups_dropped,
        "grpo_size": cfg.grpo_size,
        "learner_steps": records[-1]["step"] if records else 0,
        "reward_first20": first, "reward_last20": last, "reward_last10": last10,
        "target_reward": cfg.target_reward,
        "reached_target": (cfg.target_reward is not None and len(rewards) >= 10 and last10 is not None
                           and last10 >= cfg.target_reward),
        "timing": timing_summary(records),
        "stale_trajectories": int(final.get("learner", {}).get("stale_trajectories", 0)),
        "restarts": sum(w.restarts for w in workers[1:]),
        "learner_restarts": workers[0].restarts if workers else 0,  # --engine ray: Ray restarted its actor
        "learner_start_step": int(final.get("learner", {}).get("start_step", 0)),  # its last (re)start
        "worker_exits": {w.name: w.exits for w in workers if w.exits},
        "duration_s": round(time.time() - t0, 2),
        "store": str(store), "run_dir": str(run_dir), "plot": str(plot) if plot else None,
        "session": session, "grouping_stats": stats,
        "collectors": {k: final.get(k, 0) for k in ("units", "reissued_samples", "lost_leases")},
        "peak_rss_mb": session_peaks(run_dir, since=t0),  # per process role, MB
        "conservation_ok": bool(stats) and balanced and session["lost_in_flight"] is not None
        and 0 <= session["lost_in_flight"] <= kills * max(1, session["largest_handover"]),
    }
    (run_dir / SUMMARY).write_text(json.dumps(summary, indent=2, default=str))
    return summary
