"""Staging area: per-process subdirectories, released files returned to their owner, sweeps of dead ones."""

from __future__ import annotations

import os
from pathlib import Path

import multiprocess
import pytest
import torch
from tensordict import TensorDict

from rbpipe.grouping.staging import Staging


def _td(value: float) -> TensorDict:
    return TensorDict(obs=torch.full((4, 8), value), batch_size=[4])


def _delete_in_child(path: str, handles: list[str]) -> None:
    Staging(path).delete(handles)


def _run_child(target, *args) -> int | None:
    """Run ``target`` in a ``multiprocess`` spawn child to its end (bounded by the test's timeout only: a spawned
    interpreter's start-up on a loaded machine takes what it takes); killed if the test gives up first."""
    p = multiprocess.get_context("spawn").Process(target=target, args=args)
    p.start()
    try:
        p.join()
        return p.exitcode
    finally:
        if p.is_alive():
            p.kill()
            p.join(10)


def _stage_and_die(path: str) -> None:
    s = Staging(path)
    handles = [s.put(_td(1.0)) for _ in range(3)]
    s.delete(handles[:2])  # two released files, one payload still pending
    os._exit(0)  # no atexit: as if killed


@pytest.mark.timeout(300)
def test_files_another_process_released_are_reused_by_their_owner(tmp_path):
    s = Staging(tmp_path)
    handles = [s.put(_td(float(i))) for i in range(20)]
    assert {os.path.dirname(h) for h in handles} == {s._own()}  # one subdirectory per process
    inodes = {os.stat(tmp_path / h).st_ino for h in handles}
    assert _run_child(_delete_in_child, str(tmp_path), handles) == 0
    assert s.handles() == []
    again = [s.put(_td(7.0)) for _ in range(20 + Staging.RESCAN_EVERY)]
    reused = {os.stat(tmp_path / h).st_ino for h in again} & inodes
    assert len(reused) == 20  # every released file came back to its owner instead of a new inode
    assert all(torch.equal(s.load(h)["obs"], _td(7.0)["obs"]) for h in again)
    s._recent.clear()  # read back from disk, not from memory
    assert all(torch.equal(s.load(h)["obs"], _td(7.0)["obs"]) for h in again)


@pytest.mark.timeout(300)
def test_sweep_removes_a_dead_process_released_files_but_keeps_its_pending_payloads(tmp_path):
    assert _run_child(_stage_and_die, str(tmp_path)) == 0
    s = Staging(tmp_path)
    (pending,) = s.handles()
    assert len(list((tmp_path / os.path.dirname(pending)).iterdir())) == 3
    assert s.sweep() == 2
    assert s.handles() == [pending]  # still queued work: kept for the resumed run
    assert torch.equal(s.load(pending)["obs"], _td(1.0)["obs"])
    s.delete([pending])
    s.sweep()
    assert not (tmp_path / os.path.dirname(pending)).exists()  # nothing left: the directory goes too


@pytest.mark.timeout(60)
def test_default_staging_is_in_shared_memory_and_removed_at_shutdown(grouping_manager):
    from rbpipe.grouping import SharedMCAdvantage
    from rbpipe.system.procs import shared_memory_dir

    t = SharedMCAdvantage(2, manager=grouping_manager)
    path = t.staging.path
    assert path.is_dir()
    if shared_memory_dir() is not None:
        assert path.parent == Path(shared_memory_dir()).resolve()
    handle = t.staging.put(_td(1.0))
    assert (path / handle).exists()
    t.shutdown()
    assert not path.exists()  # nothing left in RAM-backed /dev/shm


@pytest.mark.timeout(300)
def test_sweep_dead_files_removes_only_files_of_processes_that_are_gone(tmp_path):
    from rbpipe.system.procs import sweep_dead_files

    p = multiprocess.get_context("spawn").Process(target=os.getpid)
    p.start()
    p.join()  # bounded by the test's timeout only
    dead, alive = p.pid, os.getpid()
    names = [f"w-{dead}-a", f"w-{dead}-a.hdr", f"w-{alive}-b", f"x-{dead}-c", "w-notapid"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert sweep_dead_files(tmp_path, "w-") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"w-{alive}-b", f"x-{dead}-c", "w-notapid"])
