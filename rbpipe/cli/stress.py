"""``rbpipe stress``: hammer the shared grouping with writer processes, kill some, verify from the store.

W writer processes (``multiprocess`` spawn) push N trajectories (random group interleavings, random binary
rewards incl. all-0/all-1 groups). With ``kill_rate`` the parent SIGKILLs random writers at random moments
(mid-append included) and respawns them to finish their share; the trajectory a writer was handing over
when killed is either fully queued or not at all (counted as ``lost_in_flight``, at most one per kill).
Afterwards the store is read back and checked: no trajectory duplicated, every group whole and homogeneous,
advantages equal to the ones recomputed from the stored rewards, and the grouping counters equal to what the
store holds (``handed_over == written + dropped + unselected + queued``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import multiprocess
import torch

from rbpipe.errors import ConfigError
from rbpipe.rundir import STAGING
from rbpipe.system.procs import (
    owned_temp_dir,
    quiet_killed_worker_trackers,
    release_owned_dir,
    sweep_orphaned_socket_dirs,
)
from rbpipe.timing import STARTUP_TIMEOUT_S
from rbpipe.trajectory import GROUP_KEY, RAGGED_KEYS, REWARD_KEY, make_trajectory

UID_KEY = "uid"
#: Prefix of a run's temporary directory (the writers' shares, and its store when none is given). Its ``.owner``
#: lock is held by the run: a run that was SIGKILLed leaves it, and the next run's sweep removes it.
TMP_PREFIX = "rbpipe-stress-"
PAYLOADS = ("small", "16x64", "tok1024")


def check_stress_args(*, writers: int, trajectories: int, group_size: int | None, kill_rate: float,
                      payload: str = "small") -> None:
    """Refuse, in one line, a stress run that could only crash or report a meaningless ``ok``."""
    if writers < 1:
        raise ConfigError(f"--writers must be at least 1, got {writers}")
    if group_size is not None and group_size < 2:
        raise ConfigError(f"--group-size must be at least 2 (advantages are relative to the group), got {group_size}")
    if trajectories < (group_size or 2):
        raise ConfigError(f"--trajectories must be at least one group ({group_size or 2}), got {trajectories}")
    if not 0.0 <= kill_rate <= 1.0:
        raise ConfigError(f"--kill-rate is a probability per trajectory: between 0 and 1, got {kill_rate}")
    if payload not in PAYLOADS:
        raise ConfigError(f"--payload must be one of {', '.join(PAYLOADS)}, got {payload!r}")


def make_payload_trajectory(uid: int, group: int, reward: float, payload: str, writer: int) -> Any:
    """One schema trajectory carrying ``uid`` and a payload of the requested size."""
    g = torch.Generator().manual_seed(uid)
    length = 1024 if payload == "tok1024" else 8
    td = make_trajectory(group_id=group, prompt=torch.randint(0, 50, (8,), generator=g),
                         response=torch.randint(0, 50, (length,), generator=g),
                         rollout_log_probs=-torch.rand(length, generator=g), reward=reward,
                         collector_id=writer, policy_version=0)
    td.set(UID_KEY, torch.tensor([uid], dtype=torch.int64))
    if payload == "16x64":
        td.set("obs", torch.rand(1, 16, 64, generator=g))
    return td


def _plan(trajectories: int, group_size: int, writers: int, interleave: str, seed: int,
          dynamic_sampling: bool) -> tuple[list[list[tuple[int, int, float]]], int]:
    rng = random.Random(seed)
    n_groups = max(1, trajectories // group_size)
    items = []
    for gid in range(n_groups):
        kind = rng.random()
        for m in range(group_size):
            reward = 0.0 if kind < 0.15 else 1.0 if kind < 0.3 else float(rng.random() < 0.5)
            items.append((gid * group_size + m, gid, reward))
    if interleave == "random":
        rng.shuffle(items)
    elif interleave == "round-robin":
        items.sort(key=lambda it: (it[0] % group_size, it[1]))
    shares: list[list] = [[] for _ in range(writers)]
    for item in items:
        shares[rng.randrange(writers)].append(item)
    return shares, n_groups * group_size


#: Tensor sharing for torchrl's stock shared transform: it sends every queued tensor through a stdlib manager,
#: and with torch's default ("file_descriptor") each one holds a descriptor in the manager until a client
#: takes it; a few thousand queued 1,024-token trajectories exhausted a 20,000-descriptor limit.
STOCK_SHARING = "file_system"


def _writer_main(w: int, buffer, share_path: str, payload: str, progress, inflight, start: int,
                 sharing: str, up) -> None:
    from rbpipe.system.procs import _parent_pid, die_with_parent

    die_with_parent(_parent_pid())
    torch.set_num_threads(1)
    torch.multiprocessing.set_sharing_strategy(sharing)
    share = json.loads(Path(share_path).read_text())
    for i in range(start, len(share)):
        uid, gid, reward = share[i]
        td = make_payload_trajectory(uid, gid, reward, payload, w)
        inflight[w] = i
        buffer.extend(td)
        progress[w] = i + 1
        up[w] = 1  # after the first hand-over: it opens the manager connection and staging, seconds under load


def _open_storage(store: Path):
    from rbpipe.storage import ArrowStorage

    return ArrowStorage(store, ragged_keys=RAGGED_KEYS, group_key=GROUP_KEY)


def run_stress(*, writers: int = 4, trajectories: int = 2000, group_size: int | None = None,
               payload: str = "small", interleave: str = "random", kill_rate: float = 0.0, seed: int = 0,
               grouping: str = "rbpipe", store=None, dynamic_sampling: bool = False,
               stall_timeout: float = 30.0, max_kills: int | None = None) -> dict[str, Any]:
    """Run one stress round and verify it from the store; returns the report dict (``ok`` is the verdict)."""
    check_stress_args(writers=writers, trajectories=trajectories, group_size=group_size, kill_rate=kill_rate,
                      payload=payload)
    rng = random.Random(seed)
    group_size = group_size or rng.randint(2, min(8, trajectories))
    sweep_orphaned_socket_dirs(prefix=TMP_PREFIX)  # those of runs that were killed
    tmp = Path(owned_temp_dir(TMP_PREFIX))
    own_store = store is None
    store = Path(store) if store is not None else tmp / "store"
    try:
        report = _run(tmp, store, own_store, writers=writers, trajectories=trajectories, group_size=group_size,
                      payload=payload, interleave=interleave, kill_rate=kill_rate, seed=seed, rng=rng,
                      grouping=grouping, dynamic_sampling=dynamic_sampling, stall_timeout=stall_timeout,
                      max_kills=max_kills)
    except BaseException:  # a writer failed, Ctrl-C: nothing to inspect, nothing left in /tmp
        release_owned_dir(tmp)
        raise
    if own_store and not report["ok"]:  # a temporary store is kept only when it shows a problem to look at
        for path in tmp.glob("share*.json"):
            path.unlink(missing_ok=True)
        release_owned_dir(tmp, remove=False)
        report["store_kept_for_inspection"] = True
    else:  # the writers' shares (and our own store): a store given by the caller is elsewhere
        release_owned_dir(tmp)
        if own_store:
            report["store"] = None
    return report


def _run(tmp: Path, store: Path, own_store: bool, *, writers: int, trajectories: int, group_size: int,
         payload: str, interleave: str, kill_rate: float, seed: int, rng: random.Random, grouping: str,
         dynamic_sampling: bool, stall_timeout: float, max_kills: int | None) -> dict[str, Any]:
    """The run itself, in ``tmp`` (removed or kept by :func:`run_stress`)."""
    from rbpipe.buffer import make_replay_buffer, start_manager

    shares, produced = _plan(trajectories, group_size, writers, interleave, seed, dynamic_sampling)
    share_paths = []
    for w, share in enumerate(shares):
        p = tmp / f"share{w}.json"
        p.write_text(json.dumps(share))
        share_paths.append(str(p))
    storage = _open_storage(store)
    kwargs: dict[str, Any] = dict(trajectory_return="sum")
    if dynamic_sampling:
        kwargs["keep_return_bounds"] = (0.01, 0.99)
    manager = start_manager() if grouping == "rbpipe" else None
    sharing_before = torch.multiprocessing.get_sharing_strategy()
    sharing = STOCK_SHARING if grouping == "torchrl" else sharing_before
    torch.multiprocessing.set_sharing_strategy(sharing)  # before torchrl forks its manager
    ctx = multiprocess.get_context("spawn")
    buffer = make_replay_buffer(storage, grouping=grouping, grpo_size=group_size, manager=manager,
                                staging_dir=store / STAGING, **kwargs)
    progress = ctx.Array("q", writers, lock=False)
    inflight = ctx.Array("q", [-1] * writers, lock=False)
    up = ctx.Array("b", writers, lock=False)  # a writer sets its flag once its first hand-over returned
    procs: list = [None] * writers
    kills = skipped = 0
    hung = False
    reason = None
    t0 = time.time()

    def spawn(w: int, start: int):
        up[w] = 0
        p = ctx.Process(target=_writer_main, args=(w, buffer, share_paths[w], payload, progress, inflight, start,
                                                   sharing, up), daemon=True)
        with quiet_killed_worker_trackers():
            p.start()
        procs[w] = p
        spawned[w] = time.time()

    spawned = [0.0] * writers

    try:
        for w in range(writers):
            spawn(w, 0)
        done_before, last_change, first_handover = 0, time.time(), None
        while True:
            time.sleep(0.05)
            done_now = sum(progress[:])
            if done_now != done_before:
                last_change = time.time()
                first_handover = first_handover or last_change  # throughput excludes process start-up
            delta, done_before = done_now - done_before, done_now
            for w, p in enumerate(procs):
                if p is not None and not p.is_alive():
                    p.join()
                    if p.exitcode > 0:
                        raise RuntimeError(f"stress writer {w} failed (exit code {p.exitcode}); see its output")
                    if p.exitcode < 0 and progress[w] < len(shares[w]):  # killed: respawn for the rest
                        start = progress[w]
                        if inflight[w] == start:  # killed while handing it over: queued in full or not at all
                            start += 1
                            progress[w] = start
                            skipped += 1
                        spawn(w, start) if start < len(shares[w]) else procs.__setitem__(w, None)
                    else:
                        procs[w] = None
            if all(p is None for p in procs):
                break
            if kill_rate > 0 and delta > 0 and (max_kills is None or kills < max_kills) \
                    and rng.random() < 1 - (1 - kill_rate) ** delta:
                alive = [w for w, p in enumerate(procs) if p is not None and p.is_alive()]
                if alive:
                    victim = rng.choice(alive)
                    os.kill(procs[victim].pid, signal.SIGKILL)
                    kills += 1
            reason = _stall(procs, up, spawned, last_change, stall_timeout, progress, shares)
            if reason:
                hung = True
                break
        seconds = time.time() - t0
        busy = time.time() - (first_handover or t0)
        if grouping == "rbpipe" and not hung:
            buffer.recover(force=True)  # finish groups claimed by killed writers
            buffer.confirm_stored()  # and delete what writers killed after their commit left staged
        stats = dict(buffer.grouping_transform.get_stats()) if not hung else {}
    finally:
        for p in procs:
            if p is not None and p.is_alive():
                p.kill()
                p.join(5)
        if manager is not None:
            manager.shutdown()
        torch.multiprocessing.set_sharing_strategy(sharing_before)
        storage.flush_catalog()  # rows of the groups recovered here first, or the repair lists them a second time
        _complete_catalogue(store)
    attempted = sum(progress[:])  # includes the `skipped` in-flight ones
    report = verify_store(store, group_size=group_size, stats=stats)
    handed = int(stats.get("completed_trajectories", 0))
    report.update(impl=grouping, writers=writers, group_size=group_size, payload=payload, interleave=interleave,
                  produced=produced, attempted=attempted, in_flight_at_kill=skipped, handed_over=handed, kills=kills,
                  lost_in_flight=attempted - handed if stats else None, hung=hung,
                  seconds=round(seconds, 2), traj_per_s=round(attempted / max(busy, 1e-9), 1),
                  store=str(store))
    report["lost"] = handed - (report["written"] + report["dropped"] + report["unselected"] + report["queued"])
    report["reason"] = reason or _failure_reason(report, kills, attempted, produced)
    report["ok"] = report["reason"] is None
    return report


def _stall(procs: list, up, spawned: list[float], last_change: float, stall_timeout: float, progress,
           shares: list) -> str | None:
    """Why the run counts as hung, or None. A writer still starting (a fresh interpreter importing torch) is
    given ``STARTUP_TIMEOUT_S``; the stall timer counts only while every live writer is up."""
    now = time.time()
    starting = [w for w, p in enumerate(procs) if p is not None and not up[w]]
    late = [w for w in starting if now - spawned[w] > STARTUP_TIMEOUT_S]
    if late:
        return (f"writer(s) {late} not up {STARTUP_TIMEOUT_S:.0f}s after being started (process start-up and "
                "imports); the machine may be overloaded")
    if starting:
        return None
    idle = now - max([last_change] + [spawned[w] for w, p in enumerate(procs) if p is not None])
    working = [w for w, p in enumerate(procs) if p is not None and progress[w] < len(shares[w])]
    if not working:  # every live writer handed over its whole share and is exiting
        if idle > STARTUP_TIMEOUT_S:
            return f"writers finished their shares but did not exit within {STARTUP_TIMEOUT_S:.0f}s"
        return None
    if idle > stall_timeout:
        done = [f"{progress[w]}/{len(shares[w])}" for w in range(len(procs))]
        return (f"no trajectory handed over for {idle:.0f}s (stall limit {stall_timeout:g}s) with every writer "
                f"up; writers' progress {done}")
    return None


def _failure_reason(report: dict[str, Any], kills: int, attempted: int, produced: int) -> str | None:
    """The first check that failed, in words (None when the store verifies)."""
    if report["lost"]:
        return f"{report['lost']} trajectories handed over are neither written, dropped, unselected nor queued"
    if report["duplicated"]:
        return f"{report['duplicated']} trajectories stored twice"
    if report["torn_groups"]:
        return f"{report['torn_groups']} stored groups are not whole or mix group ids"
    if report["advantage_errors"]:
        return f"{report['advantage_errors']} groups have advantages that differ from their normalised returns"
    if not report["stats_match_store"]:
        return (f"the grouping counters ({report['stats'].get('written_groups')} groups written) disagree with "
                f"the store ({report['groups_in_store']} groups, {report['written']} rows)")
    lost = report["lost_in_flight"]
    if lost is None or not 0 <= lost <= kills:
        return f"{lost} trajectories lost in flight for {kills} kills (at most one per kill)"
    if kills == 0 and attempted != produced:
        return f"only {attempted} of {produced} trajectories were handed over"
    return None


def _complete_catalogue(store: Path) -> None:
    """Add catalogue rows for groups committed by writers killed before they flushed theirs, as ``rbpipe run``
    does: whoever reads the store with DuckDB/Polars afterwards sees what the report counts."""
    from rbpipe.storage.catalog import repair_catalog

    try:
        repair_catalog(store)
    except Exception as err:  # noqa: BLE001 - the verification below reads the commit log, not the catalogue
        print(f"rbpipe stress: catalogue repair skipped: {err}", flush=True)


def verify_store(store: Path, *, group_size: int, stats: dict) -> dict[str, Any]:
    """Read the store back and check groups, duplicates and advantages against ``stats``."""
    storage = _open_storage(store)
    n = len(storage)
    spans = storage.group_spans() if n else torch.zeros(0, 3, dtype=torch.int64)
    duplicated = torn = adv_errors = 0
    if n:
        rows = storage.get(torch.arange(n))
        uids = rows.get(UID_KEY).reshape(-1)
        gids = rows.get(GROUP_KEY).reshape(-1)
        rewards = rows.get(REWARD_KEY).reshape(n, -1).sum(-1).double()
        advs = rows.get("advantage").reshape(n, -1)[:, 0].double()
        duplicated = int(uids.numel() - uids.unique().numel())
        for _, a, b in spans.tolist():
            if b - a != group_size or gids[a:b].unique().numel() != 1:
                torn += 1
                continue
            r = rewards[a:b]
            expected = (r - r.mean()) / r.std().clamp_min(1e-6)
            adv_errors += int(not torch.allclose(advs[a:b], expected, atol=1e-5, rtol=1e-5))
    dropped = int(stats.get("dropped_groups", 0)) * group_size
    written_groups = int(stats.get("written_groups", -1))
    return {"written": n, "groups_in_store": int(spans.shape[0]), "dropped": dropped,
            "unselected": int(stats.get("unselected_trajectories", 0)),
            "queued": int(stats.get("queued_trajectories", 0)), "duplicated": duplicated, "torn_groups": torn,
            "advantage_errors": adv_errors,
            "stats_match_store": written_groups == int(spans.shape[0]) and n == written_groups * group_size,
            "stats": stats}


def format_stress_table(result: dict[str, Any]) -> str:
    """Human-readable summary of one :func:`run_stress` report."""
    keys = ("impl", "writers", "group_size", "payload", "interleave", "produced", "handed_over", "written",
            "dropped", "unselected", "queued", "lost", "lost_in_flight", "duplicated", "torn_groups",
            "advantage_errors", "kills", "hung", "traj_per_s", "seconds", "ok", "reason", "store")
    width = max(len(k) for k in keys)
    lines = [f"rbpipe stress ({result.get('impl')})"]
    lines += [f"  {k:<{width}}  {result.get(k)}" for k in keys]
    return "\n".join(lines)
