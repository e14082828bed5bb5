"""Concurrent writer processes (multiprocess, spawn) and SIGKILL during writes."""

from __future__ import annotations

import os
import signal

import multiprocess
import pytest
from helpers_storage import llm_group

from rbpipe.storage import ArrowStorage, ZarrStorage, inspect_store, open_storage
from rbpipe.trajectory import RAGGED_KEYS
from tests.process_helpers import wait_stopped


def _writer(storage, wid, n_groups):
    import sys
    sys.path.insert(0, os.path.dirname(__file__)) if "__file__" in globals() else None
    from helpers_storage import llm_group as make
    for k in range(n_groups):
        storage.append_group(make(wid * 1000 + k, n=4))
    storage.close()


def _write_until_frozen(path, cls_name, freeze_at):
    """Commit ``freeze_at`` whole groups, then write the next group's data and stop this process (SIGSTOP to
    itself) before that group's commit: the test SIGKILLs it there, the point under test, never at a time."""
    import torch
    from tensordict import TensorDict, lazy_stack

    import rbpipe.storage as st
    from rbpipe.storage.ledger import Ledger
    from rbpipe.trajectory import RAGGED_KEYS as RK

    commit_group = Ledger.commit_group

    def frozen_commit(self, *args, **kwargs):
        if k == freeze_at:  # the group's data is on disk; its commit line is not
            os.kill(os.getpid(), signal.SIGSTOP)
        return commit_group(self, *args, **kwargs)

    Ledger.commit_group = frozen_commit
    s = getattr(st, cls_name)(path, ragged_keys=RK)
    for k in range(freeze_at + 1):
        rows = [TensorDict({"group_id": torch.tensor(k), "tokens": {"prompt": torch.zeros(3, dtype=torch.int64),
                            "response": torch.ones(200 + i, dtype=torch.int64)},
                            "log_probs": {"rollout": torch.zeros(200 + i)},
                            "next": {"reward": torch.ones(1), "done": torch.ones(1, dtype=torch.bool)},
                            "collector_id": torch.tensor(1), "policy_version": torch.tensor(k),
                            "advantage": torch.zeros(1)}, batch_size=[]) for i in range(4)]
        s.append_group(lazy_stack(rows, 0))
    raise AssertionError("the writer was not killed at its freeze point")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cls", [ArrowStorage, ZarrStorage])
def test_concurrent_writer_processes_lose_nothing(tmp_path, cls):
    store = cls(tmp_path / "s", ragged_keys=RAGGED_KEYS)
    store.append_group(llm_group(999))  # schema first, from the parent
    ctx = multiprocess.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(store, w, 15)) for w in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join()  # bounded by the test's timeout: a spawned child's start alone took ~100 s at load 18
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert len(store) == 4 * 31
    gids = store.get(slice(None))["group_id"].tolist()
    spans = store.group_spans()
    for _, a, b in spans.tolist():  # every group contiguous and whole
        assert len(set(gids[a:b])) == 1 and b - a == 4
    assert sorted(set(gids)) == sorted([999] + [w * 1000 + k for w in range(2) for k in range(15)])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cls_name", ["ArrowStorage", "ZarrStorage"])
def test_sigkill_during_writes_leaves_only_whole_groups(tmp_path, cls_name):
    ctx = multiprocess.get_context("spawn")
    p = ctx.Process(target=_write_until_frozen, args=(str(tmp_path / "s"), cls_name, 3))
    p.start()
    try:
        assert wait_stopped(p.pid, 240), "the writer did not reach its freeze point"
        os.kill(p.pid, signal.SIGKILL)  # its 4th group's data written, its commit line not
        p.join(30)
    finally:
        if p.is_alive():
            p.kill()
            p.join(30)
    s = open_storage(tmp_path / "s", ragged_layout="rows")
    assert len(s) == 12  # the 3 committed groups, not the one killed before its commit
    td = s.get(slice(None))
    for _, a, b in s.group_spans().tolist():
        assert b - a == 4
        for i in range(a, b):
            assert td[i]["tokens", "response"].shape[0] == 200 + (i - a)
            assert int(td[i]["group_id"]) == int(td[a]["group_id"])
    info = inspect_store(tmp_path / "s")
    assert info["groups_committed"] == len(s) // 4
    s.append_group(td[0:4])  # the store stays writable after the crash
    assert len(open_storage(tmp_path / "s")) == len(s)
    if cls_name == "ArrowStorage":  # the dead writer's segment is reported, never served
        (dead,) = s.check_tail()["dead_segments_with_uncommitted_bytes"]
        assert dead["uncommitted_bytes"] > 0
