"""``rbpipe stress`` reports (issue 16, item 4): no false "hung" from process start-up, a reason whenever it
fails, where the store it kept is, a complete Parquet catalogue after kills, no leaked-semaphore noise."""

from __future__ import annotations

import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from rbpipe.cli.stress import format_stress_table, run_stress


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

    import rbpipe.cli.stress as stress

    monkeypatch.setattr(stress, "STARTUP_TIMEOUT_S", 0.05)  # no writer can be up this fast: a stall
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the store kept for inspection: in tmp_path
    report = run_stress(writers=1, trajectories=8, group_size=4, seed=1, stall_timeout=0.05)
    table = format_stress_table(report)
    assert not report["ok"] and report["reason"], table
    assert "reason" in table and report["store"] and report["store"] in table
    assert report["store"].startswith(str(tmp_path))


@pytest.mark.timeout(600)  # each kill respawns a writer (a fresh interpreter): minutes on a loaded machine
def test_killed_writers_leave_a_complete_catalogue_and_no_semaphore_warnings(tmp_path):
    store = tmp_path / "store"
    out = subprocess.run([sys.executable, "-m", "rbpipe.cli", "stress", "--writers", "2", "--trajectories", "160",
                          "--group-size", "4", "--kill-rate", "0.05", "--seed", "3", "--store", str(store), "--json"],
                         capture_output=True, text=True, timeout=590)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    import json

    report = json.loads(out.stdout)
    assert report["kills"] > 0, report
    assert "leaked semaphore" not in out.stderr, out.stderr[-3000:]
    catalogue = pq.read_table(str(store / "catalog"))
    rows = [r for r in catalogue.to_pylist() if r.get("live", True)]
    assert sum(r["members"] for r in rows) == report["written"]


def _stress_dirs(root) -> list:
    return sorted(p.name for p in root.glob("rbpipe-stress-*"))


@pytest.mark.timeout(600)
def test_a_failed_writer_leaves_no_temporary_directory(tmp_path, monkeypatch):
    import tempfile

    import rbpipe.cli.stress as stress

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # a share whose trajectory cannot be built: the writer exits with an error
    monkeypatch.setattr(stress, "_plan", lambda *args: ([[(0, 0, "not a reward")]], 4))
    with pytest.raises(RuntimeError, match="stress writer 0 failed"):
        run_stress(writers=1, trajectories=4, group_size=4, seed=1)
    assert _stress_dirs(tmp_path) == []


@pytest.mark.timeout(600)
def test_a_sigkilled_stress_run_leaves_its_directory_to_the_next_run(tmp_path, monkeypatch):
    import os
    import signal
    import tempfile
    import time

    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "rbpipe.cli", "stress", "--writers", "1", "--trajectories",
                             "1000000", "--group-size", "4", "--seed", "3", "--json"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300  # a fresh interpreter importing torch: minutes on a loaded machine
        while not list(tmp_path.glob("rbpipe-stress-*/share0.json")):  # the run is under way (a cap it never reaches)
            assert proc.poll() is None and time.monotonic() < deadline, "the stress run did not start"
            time.sleep(0.05)
        (left,) = _stress_dirs(tmp_path)
        os.kill(proc.pid, signal.SIGKILL)  # the run only: its writers and manager follow it (they watch it)
        proc.wait(30)
        while True:  # until its whole process group is gone
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline + 60, "the killed run's children did not exit"
            time.sleep(0.05)
        assert _stress_dirs(tmp_path) == [left]  # a SIGKILL skips every clean-up
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        report = run_stress(writers=1, trajectories=8, group_size=4, seed=1)
        assert report["ok"], format_stress_table(report)
        assert _stress_dirs(tmp_path) == []  # the next run swept it (its owner's lock was free), and removed its own
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)
