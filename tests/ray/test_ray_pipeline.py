"""``rbpipe run --engine ray`` on a 3-node cluster: collectors pinned to two worker nodes, the learner to the
head, grouping over 2 shard actors; then the run's summary, placement and store are checked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ray_helpers import check_store, ray_env, ray_run_cmd

STEPS = 150
LEFT_BEHIND: list[str] = []  # named semaphores the run left in /dev/shm


def _semaphores() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("sem.")}


@pytest.fixture(scope="module")
def cluster_run(ray_cluster, tmp_path_factory) -> tuple[Path, dict]:
    cluster, _ = ray_cluster
    run_dir = tmp_path_factory.mktemp("ray") / "run"
    # the default recipe (groups of 8, 8 a step), long enough to see the reward rise as the local engine's do
    cmd = ray_run_cmd(cluster.address, run_dir, "--grpo-size", "8", "--groups-per-step", "8", "--lr", "0.002",
                      steps=STEPS)
    before = _semaphores()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=ray_env())
    LEFT_BEHIND.extend(sorted(_semaphores() - before))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run_dir, json.loads(out.stdout)


@pytest.mark.timeout(300)
def test_summary_conservation_and_learner_steps(cluster_run):
    run_dir, summary = cluster_run
    assert summary["status"] == "done" and summary["engine"] == "ray" and summary["grouping_shards"] == 2
    assert summary["conservation_ok"] is True
    assert summary["learner_steps"] == STEPS
    assert summary["produced"] == (summary["written"] + summary["dropped"] + summary["unselected"]
                                   + summary["queued"] + summary["rejected"])
    assert summary["written"] == summary["groups_written"] * 8


@pytest.mark.timeout(300)
def test_workers_ran_on_the_nodes_they_were_pinned_to(cluster_run, ray_cluster):
    run_dir, _ = cluster_run
    _, nodes = ray_cluster
    placed = {w["worker"]: w["node_id"] for w in json.loads((run_dir / "ray_workers.json").read_text())["workers"]}
    assert placed["learner"] == nodes["head"].node_id
    assert placed["collector 0"] == nodes["node_b"].node_id
    assert placed["collector 1"] == nodes["node_c"].node_id


@pytest.mark.timeout(300)
def test_groups_whole_normalised_and_mixing_nodes(cluster_run):
    run_dir, summary = cluster_run
    groups = check_store(run_dir, summary)
    # collector 0 ran on node_b, collector 1 on node_c: a group with both crossed nodes (and shards' hands)
    mixed = [g for g in groups if sorted({int(c) for c in g["collectors"]}) == [0, 1]]
    assert len(mixed) >= len(groups) // 2, [g["collectors"] for g in groups]


@pytest.mark.timeout(60)
def test_ray_listens_on_loopback_only(ray_cluster):
    """Every TCP listener of this process's descendants (GCS, raylets, object managers, workers) is on lo."""
    import os

    out = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True, timeout=30).stdout
    mine = _descendants(os.getpid())
    ours, elsewhere = [], []
    for line in out.splitlines():
        fields = line.split()
        local = fields[3]
        pids = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if not pids & mine:
            continue
        ours.append(local)
        host = local.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")  # v4-mapped: [::ffff:127.0.0.1]
        if host != "::1" and not host.startswith("127."):
            elsewhere.append(line)
    assert len(ours) >= 6, out  # the cluster is up and ss saw its processes
    assert not elsewhere, "\n".join(elsewhere)


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    seen, todo = set(), [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


@pytest.mark.timeout(300)
def test_serve_on_ray_with_workers_attached_from_shells(ray_cluster, tmp_path):
    """``rbpipe serve --engine ray``: a collector and the learner started as separate programs attach through
    ``endpoint.json`` (Ray namespace and actor names), train to ``--steps``, and the service ends by itself."""
    import sys
    import time

    cluster, _ = ray_cluster
    run_dir = tmp_path / "served"
    base = [sys.executable, "-m", "rbpipe.cli"]
    serve = subprocess.Popen(base + ["serve", "--no-progress", "--json", "--engine", "ray", "--ray-address",
                                     cluster.address, "--run-dir", str(run_dir), "--steps", "3", "--grpo-size", "4",
                                     "--groups-per-step", "2", "--collectors", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ray_env())
    workers = []
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "endpoint.json").exists():
            assert serve.poll() is None and time.monotonic() < deadline, serve.communicate()[1][-3000:]
            time.sleep(0.2)
        for kind in ("collector", "learner"):
            workers.append(subprocess.Popen(base + [kind, "--connect", str(run_dir)], stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True, env=ray_env()))
        out, err = serve.communicate(timeout=200)
        assert serve.returncode == 0, err[-3000:]
        for w in workers:
            text, _ = w.communicate(timeout=60)
            assert w.returncode == 0, text[-3000:]
    finally:
        for p in [serve, *workers]:
            if p.poll() is None:
                p.kill()
    summary = json.loads(out)
    assert summary["status"] == "done" and summary["learner_steps"] == 3 and summary["conservation_ok"]


@pytest.mark.timeout(300)
def test_the_learner_trains_on_exactly_the_stored_rows_and_its_reward_rises(cluster_run):
    from tests.test_pipeline import check_trained_rows

    run_dir, summary = cluster_run
    check_trained_rows(run_dir, groups=8 * STEPS)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sql = "select cast(sum(members) as bigint) as n from groups"
    catalogued = subprocess.run([sys.executable, "-m", "rbpipe.cli", "query", str(run_dir / "store"), sql, "--json"],
                                capture_output=True, text=True, timeout=120)
    assert json.loads(catalogued.stdout)["rows"] == [{"n": summary["written"]}]
    rewards = [r["reward_mean"] for r in records]
    third = len(rewards) // 3
    assert sum(rewards[-third:]) / third > sum(rewards[:third]) / third + 0.05, rewards


@pytest.mark.timeout(60)
def test_the_run_leaves_no_named_semaphore_behind(cluster_run):
    """Ray kills its worker actors at the end: anything they held as a named semaphore would stay in /dev/shm."""
    assert LEFT_BEHIND == []
