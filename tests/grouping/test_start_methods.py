"""How writer processes may be started (issue 33). The grouping manager's proxies carry its authkey only when
the ``multiprocess`` package starts the child (any of its methods) or when the child is forked (stdlib/torch
``fork``, ``os.fork``: the connection is reset there, ``test_fork_safety``). A child of stdlib/torch ``spawn`` or
``forkserver`` would fail with ``AuthenticationError`` on its first call: refused in the parent, in one line.
A lazy torchrl storage first written in a forked child would be allocated there alone (the parent's stays empty,
silently): the child is refused before it hands anything over."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch
import torch.multiprocessing
from torchrl.data import LazyMemmapStorage, LazyTensorStorage

from rbpipe.buffer import allocate_storage, make_replay_buffer
from rbpipe.errors import ConfigError
from rbpipe.grouping import SharedMCAdvantage
from rbpipe.storage import ArrowStorage
from tests.grouping.helpers import MINIMAL_KEYS, traj, writer_main


def _noop(_obj) -> None:
    pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["stdlib-spawn", "stdlib-forkserver", "torch-spawn"])
def test_stdlib_spawn_and_forkserver_children_are_refused_in_the_parent(grouping_manager, tmp_path, how):
    t = SharedMCAdvantage(2, prompt_key="group_id", manager=grouping_manager, staging_dir=tmp_path / "staging",
                          required_keys=MINIMAL_KEYS)
    lib, method = how.split("-")
    ctx = (multiprocessing if lib == "stdlib" else torch.multiprocessing).get_context(method)
    for obj in (t, make_replay_buffer(ArrowStorage(tmp_path / "store"), grpo_size=2, manager=grouping_manager,
                                      staging_dir=tmp_path / "staging", required_keys=MINIMAL_KEYS)):
        proc = ctx.Process(target=_noop, args=(obj,))
        with pytest.raises(ConfigError, match=f"'{method}' start method.*multiprocess") as info:
            proc.start()
        assert "\n" not in str(info.value)
        assert proc._popen is None  # nothing was started


def _example():
    """A written row's layout: a trajectory with its advantage."""
    example = traj(9, 9, [0.0])
    example.set("advantage", torch.zeros(1, 1))
    return example


def _fork_writer(buffer, items, conn) -> None:
    try:
        writer_main(buffer, items)
    except ConfigError as err:
        conn.send(str(err))
    else:
        conn.send(None)


def _forked(buffer, items) -> str | None:
    """Run ``writer_main`` in a stdlib ``fork`` child; its ConfigError message, or None."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_fork_writer, args=(buffer, items, child))
    proc.start()
    try:
        assert parent.poll(60), "the forked writer did not answer"
        return parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


@pytest.mark.timeout(120)
def test_a_forked_writer_never_writes_a_torchrl_storage_the_parent_cannot_see(grouping_manager, tmp_path):
    items = [(0, 1, [1.0]), (1, 1, [0.0])]
    lazy = LazyMemmapStorage(16, scratch_dir=tmp_path / "memmap")
    buffer = make_replay_buffer(lazy, grpo_size=2, manager=grouping_manager, staging_dir=tmp_path / "staging",
                                required_keys=MINIMAL_KEYS)
    message = _forked(buffer, items)  # not allocated yet: the child would allocate its own
    assert message is not None, "a forked child allocated the storage for itself: the parent's stays empty"
    assert "not allocated yet" in message and "\n" not in message
    assert buffer.grouping_transform.get_stats()["completed_trajectories"] == 0  # refused before the hand-over

    private = LazyTensorStorage(16)
    allocate_storage(private, _example())  # allocated, but in this process's private memory
    other = make_replay_buffer(private, grpo_size=2, manager=grouping_manager, staging_dir=tmp_path / "staging",
                               required_keys=MINIMAL_KEYS)
    message = _forked(other, items)
    assert message is not None and "private memory" in message and "\n" not in message

    allocate_storage(lazy, _example())  # allocated in the parent, memory-mapped: the child writes into it
    assert _forked(buffer, items) is None
    assert len(lazy) == 2 and sorted(lazy[:2].get("uid").reshape(-1).tolist()) == [0, 1]
    assert os.getpid() == buffer._made_in
