"""``rbpipe stress`` reports (issue 16, item 4): no false "hung" from process start-up, a reason whenever it
fails, where the store it kept is, a complete Parquet catalogue after kills, no leaked-semaphore noise."""

from __future__ import annotations

import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from rbpipe.stress import format_stress_table, run_stress


@pytest.mark.timeout(120)
def test_stall_timer_starts_once_the_writers_are_up(tmp_path):
    """Spawning a writer (a fresh interpreter importing torch) takes longer than this stall limit."""
    report = run_stress(writers=2, trajectories=32, group_size=4, seed=1, store=tmp_path / "store",
                        stall_timeout=2.0)
    assert not report["hung"], format_stress_table(report)
    assert report["ok"], format_stress_table(report)


@pytest.mark.timeout(120)
def test_a_failed_stress_run_says_why_and_where_its_store_is(tmp_path, monkeypatch):
    import tempfile

    import rbpipe.stress as stress

    monkeypatch.setattr(stress, "STARTUP_TIMEOUT_S", 0.05)  # no writer can be up this fast: a stall
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the store kept for inspection: in tmp_path
    report = run_stress(writers=1, trajectories=8, group_size=4, seed=1, stall_timeout=0.05)
    table = format_stress_table(report)
    assert not report["ok"] and report["reason"], table
    assert "reason" in table and report["store"] and report["store"] in table
    assert report["store"].startswith(str(tmp_path))


@pytest.mark.timeout(180)
def test_killed_writers_leave_a_complete_catalogue_and_no_semaphore_warnings(tmp_path):
    store = tmp_path / "store"
    out = subprocess.run([sys.executable, "-m", "rbpipe.cli", "stress", "--writers", "2", "--trajectories", "160",
                          "--group-size", "4", "--kill-rate", "0.05", "--seed", "3", "--store", str(store), "--json"],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    import json

    report = json.loads(out.stdout)
    assert report["kills"] > 0, report
    assert "leaked semaphore" not in out.stderr, out.stderr[-3000:]
    catalogue = pq.read_table(str(store / "catalog"))
    rows = [r for r in catalogue.to_pylist() if r.get("live", True)]
    assert sum(r["members"] for r in rows) == report["written"]
