"""Faults on the Ray engine: a collector actor killed mid-run (``ray.kill``), a worker node removed; the run
finishes, nothing is lost beyond what was in flight, no group is torn or stored twice.

Each fault fires while the learner holds after a given step (``RBPIPE_TEST_HOLD_AFTER_STEP``,
:mod:`rbpipe.system.fault_hooks`, forwarded to the worker actors) until the test creates a file once the fault is done:
the run cannot have passed that step, or finished, whatever the machine's speed."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from ray_helpers import check_store, ray_env, ray_run_cmd

from rbpipe.system.fault_hooks import HOLD_ENV


def _start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ray_env())


def _wait_for(predicate, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended early ({proc.returncode}): {out[-2000:]} {err[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out after {timeout} s; the run said: {proc.communicate()[1][-3000:]}")
        time.sleep(0.2)


def _steps_done(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _finish(proc: subprocess.Popen, timeout: float = 200) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the run did not finish: {err[-4000:]}")
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    return json.loads(out)


def _run_with_fault(cmd: list[str], run_dir: Path, after_steps: int, ready: str, fault) -> dict:
    """Start the run with its learner holding after step ``after_steps``, wait for that step and
    ``RUN_DIR/<ready>``, call ``fault(proc)``, release the learner, then wait for the run to finish; returns its
    summary (the run is killed if the test fails on the way)."""
    release = run_dir.parent / "release"
    proc = _start(cmd, env=dict(ray_env(), **{HOLD_ENV: f"{after_steps}:{release}"}))
    try:
        _wait_for(lambda: _steps_done(run_dir) >= after_steps and (run_dir / ready).exists(), 150, proc)
        assert _steps_done(run_dir) == after_steps  # held there
        fault(proc)
        release.touch()
        return _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def _check_summary(summary: dict, steps: int) -> None:
    assert summary["status"] == "done" and summary["learner_steps"] == steps
    assert summary["conservation_ok"] is True, (summary["session"], summary["grouping_stats"], summary["restarts"])
    # only the call the killed collector was handing over (one work unit)
    assert summary["session"]["lost_in_flight"] <= summary["session"]["largest_handover"]


@pytest.mark.timeout(300)
def test_collector_actor_killed_mid_run(ray_cluster, tmp_path):
    import ray

    cluster, _ = ray_cluster
    run_dir = tmp_path / "run"

    def kill_collector(_proc) -> None:
        namespace = json.loads((run_dir / "ray_workers.json").read_text())["namespace"]
        ray.kill(ray.get_actor("collector-0-0", namespace=namespace))

    summary = _run_with_fault(ray_run_cmd(cluster.address, run_dir, steps=8), run_dir, 2, "ray_workers.json",
                              kill_collector)
    _check_summary(summary, 8)
    assert summary["restarts"] == 1 and summary["worker_exits"]["collector 0"] == ["killed by SIGKILL"]
    check_store(run_dir, summary)


@pytest.mark.timeout(300)
def test_worker_node_removed_mid_run(ray_cluster, tmp_path):
    """Collector 1 runs on node_d, which is removed: its actor dies with the node; the replacement waits for a
    node with that resource, which joins a little later, and the run finishes."""
    cluster, _ = ray_cluster
    run_dir = tmp_path / "run"
    node_d = cluster.add_node(num_cpus=1, resources={"node_d": 1}, node_ip_address="127.0.0.1")
    pins = json.dumps({"learner": {"head": 0.01}, "collectors": [{"node_b": 0.01}, {"node_d": 0.01}]})
    cmd = ray_run_cmd(cluster.address, run_dir, steps=8)
    cmd[cmd.index("--ray-resources") + 1] = pins
    added = []

    def remove_node(_proc) -> None:
        cluster.remove_node(node_d)
        time.sleep(2)
        added.append(cluster.add_node(num_cpus=1, resources={"node_d": 1}, node_ip_address="127.0.0.1"))

    try:
        summary = _run_with_fault(cmd, run_dir, 2, "ray_workers.json", remove_node)
    finally:
        for node in added:
            cluster.remove_node(node)
    replacement = added[0]
    _check_summary(summary, 8)
    assert summary["worker_exits"]["collector 1"] == ["killed by SIGKILL"]
    placed = json.loads((run_dir / "ray_workers.json").read_text())["workers"]
    assert [w["node_id"] for w in placed if w["worker"] == "collector 1"] == [node_d.node_id, replacement.node_id]
    check_store(run_dir, summary)


@pytest.mark.timeout(300)
def test_a_shard_then_the_coordinator_killed_and_restarted_by_ray(ray_cluster, tmp_path):
    """Both kinds of service actor die in one run, one after the other, while the learner holds after step 1,
    and Ray restarts each (``max_restarts``):
    * the shard replays its log (queued groups, unconfirmed claims, counters), and writers repeat the calls the
      kill cut off;
    * the coordinator configures itself again from its saved settings and takes the live service back from
      ``prompts.json`` (the units each collector holds, collector ids, the session's counters, the learner's
      progress), takes the workers' leases in at their next renewal, and Ray runs the calls the kill cut off
      again.
    The run goes on to its step cap: no group lost, torn or stored twice, every trajectory counted, no collector
    restarted or its lease lost. (One run for both: a Ray run costs ~40 s of CI.)"""
    import ray

    cluster, _ = ray_cluster
    run_dir = tmp_path / "run"

    def kill_shard_then_coordinator(proc) -> None:
        shard = _kill_until_restarted(run_dir, "rbpipe-shard-0", proc)
        assert ray.get(shard.__ray_call__.remote(lambda self: self.replayed)) > 0
        coordinator = _kill_until_restarted(run_dir, "rbpipe-coordinator", proc)
        assert ray.get(coordinator.__ray_call__.remote(lambda self: self.restarts)) == 1

    summary = _run_with_fault(ray_run_cmd(cluster.address, run_dir, steps=8), run_dir, 1, "endpoint.json",
                              kill_shard_then_coordinator)
    _check_summary(summary, 8)
    assert summary["session"]["lost_in_flight"] == 0 and summary["restarts"] == 0
    assert summary["collectors"]["lost_leases"] == 0  # every collector kept its lease through the restarts
    assert not list(run_dir.glob("*shards"))  # the shards' logs and the coordinator's settings go with the service
    check_store(run_dir, summary)


def _kill_until_restarted(run_dir: Path, name: str, proc: subprocess.Popen):
    """``ray.kill`` the service's actor ``name`` (restart allowed) and wait until Ray brought it back; its handle."""
    import ray

    spec = json.loads((run_dir / "endpoint.json").read_text())["ray"]
    actor = ray.get_actor(spec["prefix"] + name, namespace=spec["namespace"])
    pid = ray.get(actor.pid.remote())
    ray.kill(actor, no_restart=False)
    _wait_for(lambda: _try_pid(actor) not in (None, pid), 60, proc)
    return actor


def _try_pid(actor):
    import ray

    try:
        return ray.get(actor.pid.remote(), timeout=5)
    except Exception:  # noqa: BLE001 - restarting
        return None


@pytest.mark.timeout(300)
def test_learner_actor_killed_and_restarted_by_ray_resumes_from_its_checkpoint(ray_cluster, tmp_path):
    """Ray restarts a killed learner actor (``max_restarts``) and re-runs its loop (``max_task_retries``): the new
    incarnation waits out the dead one's lease, claims the learner role, loads the latest checkpoint (model,
    optimizer, sampler, step, weights version) and trains on to the step cap. The run does not stop; every step
    is logged once, nothing is lost, torn or stored twice."""
    import ray
    import torch

    cluster, _ = ray_cluster
    run_dir = tmp_path / "run"
    at_kill: dict = {}

    def kill_learner(_proc) -> None:
        namespace = json.loads((run_dir / "ray_workers.json").read_text())["namespace"]
        learner = ray.get_actor("learner-0", namespace=namespace)
        at_kill["checkpoint_step"] = torch.load(run_dir / "checkpoint.pt", weights_only=True)["step"]
        at_kill["pid"] = ray.get(learner.info.remote())["pid"]
        ray.kill(learner, no_restart=False)
        at_kill["steps"] = _steps_done(run_dir)

    started = time.monotonic()
    cmd = ray_run_cmd(cluster.address, run_dir, "--checkpoint-every", "3", steps=8)
    # killed while it holds after step 4, between checkpoints (steps 3 and 6); its new incarnation resumes from
    # step 3 and holds after step 4 again until the test releases it, after the kill
    summary = _run_with_fault(cmd, run_dir, 4, "checkpoint.pt", kill_learner)
    resumed = summary["learner_start_step"]
    print(f"learner killed after {at_kill['steps']} steps (checkpoint at step {at_kill['checkpoint_step']}), "
          f"resumed from step {resumed}, finished at {summary['learner_steps']} in {time.monotonic() - started:.0f}s")
    _check_summary(summary, 8)
    assert summary["session"]["lost_in_flight"] == 0 and summary["restarts"] == 0  # no collector died
    assert summary["learner_restarts"] == 1
    assert summary["worker_exits"]["learner"] == ["restarted by Ray"]
    # resumed from the checkpoint of step 3, not from 0
    assert at_kill["steps"] == 4 and at_kill["checkpoint_step"] == resumed == 3
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9)), steps  # steps after the checkpoint trained again, each logged once
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["step"] == 8
    placed = [w for w in json.loads((run_dir / "ray_workers.json").read_text())["workers"] if w["worker"] == "learner"]
    assert len(placed) == 1 and placed[0]["pid"] != at_kill["pid"]  # the same actor, a new process
    check_store(run_dir, summary)


def _serve(address: str, *args: str) -> subprocess.Popen:
    import sys

    return _start([sys.executable, "-m", "rbpipe.cli", "serve", "--no-progress", "--json", "--engine", "ray",
                   "--ray-address", address, *args])


def _endpoint_of(run_dir: Path, proc: subprocess.Popen) -> None:
    def written_by_proc() -> bool:
        try:
            return json.loads((run_dir / "endpoint.json").read_text())["pid"] == proc.pid
        except (OSError, ValueError):
            return False

    _wait_for(written_by_proc, 120, proc)


@pytest.mark.timeout(300)
def test_a_resumed_service_removes_the_shard_logs_its_killed_session_left(ray_cluster, tmp_path):
    """SIGKILL of ``rbpipe serve --engine ray`` leaves its shards' logs (``RUN_DIR/<prefix>shards``: only a close
    removes them); the resumed service requeues from the staging area, not from them, so it removes them: a run
    killed and resumed N times must not keep N sessions' logs.

    Then ``kill PID`` (SIGTERM) of an attached collector and of the service stops each cleanly, as without Ray:
    ``ray.init`` installs a handler of its own that exits with status 15 and no summary."""
    import signal
    import sys

    cluster, _ = ray_cluster
    run_dir = tmp_path / "run"
    killed = _serve(cluster.address, "--run-dir", str(run_dir), "--steps", "3", "--grpo-size", "4",
                    "--groups-per-step", "2", "--collectors", "1")
    try:
        _endpoint_of(run_dir, killed)
        left = sorted(p.name for p in run_dir.glob("*shards"))
        assert len(left) == 1, left
    finally:
        killed.kill()
        killed.communicate()
    assert (run_dir / left[0]).is_dir()
    resumed = _serve(cluster.address, "--resume", str(run_dir))
    try:
        _endpoint_of(run_dir, resumed)
        now = sorted(p.name for p in run_dir.glob("*shards"))
        assert left[0] not in now and len(now) == 1, now  # its own only
        collector = subprocess.Popen([sys.executable, "-m", "rbpipe.cli", "collector", "--connect", str(run_dir)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ray_env())
        try:
            lines = []
            while not any("attached to" in line for line in lines):
                line = collector.stdout.readline()
                assert line, "".join(lines)[-3000:]  # it ended before attaching
                lines.append(line)
            collector.send_signal(signal.SIGTERM)
            text = "".join(lines) + collector.communicate(timeout=60)[0]
        finally:
            if collector.poll() is None:
                collector.kill()
                collector.communicate()
        # SIGTERM: it leaves the service cleanly (its units go back) and says so; 130 as a Ctrl-C
        assert collector.returncode == 130, text[-3000:]
        assert "rbpipe collector: interrupted (SIGTERM); it left the service cleanly" in text, text[-3000:]
        resumed.send_signal(signal.SIGTERM)
        out, err = resumed.communicate(timeout=120)
    finally:
        if resumed.poll() is None:
            resumed.kill()
            resumed.communicate()
    assert resumed.returncode == 0, err[-3000:]
    assert json.loads(out)["status"] == "stopped", out[-2000:]
    assert sorted(p.name for p in run_dir.glob("*shards")) == []  # and its own went with its close
