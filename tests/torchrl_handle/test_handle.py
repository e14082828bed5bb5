"""The handle against torchrl's own buffer, across processes, and over its lifetime.

The differential reference is torchrl's in-process ``ReplayBuffer(storage=LazyStackStorage, transform=
MCAdvantage(...))``: the same buffer and transform ``RayReplayBuffer`` runs inside its actor (starting Ray here
would cost more than the rest of these tests together). ``tests/ray/test_torchrl_handle.py`` runs the same
differential against ``RayReplayBuffer`` itself, on the Ray tests' cluster."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.objectives.llm import MCAdvantage

import rbpipe
from rbpipe.errors import BadTrajectoryError, ConfigError
from torchrl_handle.llm_stack import by_member, interleaved, synthetic_steps, write_steps


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", [{}, {"trajectory_return": "mean"},
                                     {"trajectory_return": "sum", "keep_return_bounds": (0.2, 0.8)}, "per-token"],
                         ids=["default", "trajectory-return", "return-bounds", "per-token-rewards"])
def test_same_groups_and_advantages_as_torchrls_buffer(tmp_path, options):
    per_token = options == "per-token"
    options = {} if per_token else options
    stream = interleaved(synthetic_steps(5, 4, seed=3, per_token=per_token))
    reference = ReplayBuffer(storage=LazyStackStorage(100), transform=MCAdvantage(grpo_size=4, **options),
                             batch_size=4)
    rb = rbpipe.replay_buffer(tmp_path / "store", grpo_size=4, batch_size=4, **options)
    try:
        for start in range(0, 20, 3):
            reference.extend(stream[start:start + 3])
            rb.extend(stream[start:start + 3])
        assert len(rb) == len(reference) and rb.write_count == reference.write_count
        want, got = by_member(reference[:]), by_member(rb[:])
        assert got.keys() == want.keys()
        for key, (reward, advantage) in want.items():
            assert got[key][0] == reward
            assert got[key][1] == pytest.approx(advantage, abs=1e-6)
            assert len(advantage) == len(reward) == (len(key[1]) if per_token else 1)
        stats, ref_stats = rb.grouping_stats(), reference._transform[0].get_stats()
        for name in ("completed_groups", "written_groups", "dropped_groups"):
            assert stats[name] == ref_stats[name], name
    finally:
        rb.close()


@pytest.mark.timeout(180)
def test_pickled_handle_reattaches_in_spawned_writers(tmp_path):
    rb = rbpipe.replay_buffer(tmp_path / "store", grpo_size=4, batch_size=8)
    try:
        parts = [synthetic_steps(6, 2, seed=10 + w, collector=w) for w in range(2)]  # each group: 2 + 2
        with multiprocessing.get_context("spawn").Pool(2) as pool:
            written = sum(pool.starmap(write_steps, [(rb, part) for part in parts]))
        assert written == len(rb) == rb.write_count == 24
        assert rb.grouping_stats()["queued_trajectories"] == 0
        queries = rb[:].get("query", as_list=True).tolist()
        assert sorted(set(queries)) == sorted({s["query"] for s in parts[0].unbind(0)})
        batch = rb.sample()
        assert batch.numel() == 8 and batch.get(("tokens", "full"), as_padded_tensor=True).shape[0] == 8
        copy = pickle.loads(pickle.dumps(rb))  # a copy in this process: same store, same grouping
        assert len(copy) == 24 and copy.write_count == 24
        copy.close()
    finally:
        rb.close()


@pytest.mark.timeout(60)
def test_iteration_empty_and_fresh_sampler(tmp_path):
    rb = rbpipe.replay_buffer(tmp_path / "store", grpo_size=2, batch_size=2, sampler="without_replacement")
    fresh = rbpipe.replay_buffer(tmp_path / "fresh", grpo_size=2, batch_size=4, sampler="fresh")
    try:
        steps = synthetic_steps(3, 2, seed=0)
        rb.extend(steps)
        fresh.extend(steps)
        seen = [row["text"].response for batch in rb for row in batch.unbind(0)]  # torchrl: once, then stop
        assert sorted(seen) == sorted(s["text"].response for s in steps.unbind(0))
        rb.empty(empty_write_count=False)
        assert len(rb) == 0 and rb.write_count == 6
        first = fresh.sample()
        assert first.shape[0] == 4 and len(set(first.get("query", as_list=True).tolist())) == 2  # two whole groups
    finally:
        rb.close()
        fresh.close()


@pytest.mark.timeout(60)
def test_transforms_and_bad_input(tmp_path):
    from torchrl.envs import RenameTransform

    rb = rbpipe.replay_buffer(tmp_path / "store", grpo_size=2, batch_size=2)
    try:
        rb.append_transform(RenameTransform(["done"], ["finished"], create_copy=True))  # on reads
        rb.extend(synthetic_steps(1, 2, seed=0))
        assert "finished" in rb.sample().keys()
        with pytest.raises(ConfigError, match="cannot be pickled"):
            rb.append_transform(_Local(), invert=True)
        bad = synthetic_steps(1, 2, seed=1)
        bad.set_non_tensor("meta", {"not": "storable"})
        with pytest.raises(BadTrajectoryError, match="meta.*dict"):
            rb.extend(bad)
        assert rb.grouping_stats()["queued_trajectories"] == 0  # refused before anything was queued
        with pytest.raises(ConfigError, match="unknown option"):
            rbpipe.replay_buffer(tmp_path / "x", grpo_size=2, batch_size=2, grpo=3)
        with pytest.raises(ConfigError, match="multiple of grpo_size"):
            rbpipe.replay_buffer(tmp_path / "y", grpo_size=4, batch_size=6, sampler="fresh")
    finally:
        rb.close()


class _Local:
    def inv(self, td):
        return td

    def __reduce__(self):
        raise TypeError("holds a lock")


@pytest.mark.timeout(120)
def test_owner_exit_stops_the_manager_and_leaves_nothing(tmp_path):
    """The process that made the handle ends (normally, then by SIGKILL): its grouping manager ends with it."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r})
        from tensordict import set_list_to_stack
        set_list_to_stack(True).set()
        import rbpipe
        from torchrl_handle.llm_stack import synthetic_steps
        if __name__ == "__main__":
            rb = rbpipe.replay_buffer(sys.argv[1], grpo_size=2, batch_size=2)
            rb.extend(synthetic_steps(1, 3, seed=0))  # one group written, one trajectory queued
            print(rb._spec.address, rb._manager._process.pid, flush=True)
            if sys.argv[2] == "kill":
                os.kill(os.getpid(), 9)
    """)
    owners = {how: subprocess.Popen([sys.executable, "-c", script, str(tmp_path / how), how], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for how in ("exit", "kill")}  # side by side
    for how, owner in owners.items():
        stdout, _ = owner.communicate(timeout=100)
        address, manager = stdout.split()[-2], int(stdout.split()[-1])
        for _ in range(100):  # the manager polls its owner (0.25 s)
            if not _alive(manager):
                break
            subprocess.run(["sleep", "0.1"])
        assert not _alive(manager), how
        assert not os.path.exists(os.path.dirname(address)), how  # its socket directory went with it
    reopened = rbpipe.replay_buffer(tmp_path / "exit", grpo_size=2, batch_size=2)
    try:
        assert len(reopened) == 2  # the store keeps what was committed
        assert reopened.grouping_stats()["queued_trajectories"] == 1  # the staged one is queued again
    finally:
        reopened.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.timeout(180)
def test_attaches_to_a_running_rbpipe_serve(tmp_path):
    run_dir = tmp_path / "run"
    serve = subprocess.Popen([sys.executable, "-m", "rbpipe.cli", "serve", "--no-progress", "--run-dir", str(run_dir),
                              "--grpo-size", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(1200):
            if (run_dir / "endpoint.json").exists() or serve.poll() is not None:
                break
            subprocess.run(["sleep", "0.1"])
        assert serve.poll() is None, serve.stdout.read()
        with pytest.raises(ConfigError, match="grpo_size=4 differs from the service's"):
            rbpipe.replay_buffer(run_dir=run_dir, grpo_size=4, batch_size=2)
        rb = rbpipe.replay_buffer(run_dir=run_dir, grpo_size=2, batch_size=2)
        try:
            rb.extend(synthetic_steps(2, 2, seed=0))
            assert len(rb) == rb.write_count == 4
            assert rb.store == run_dir / "store"
            assert rb.sample().get(("tokens", "full"), as_padded_tensor=True).shape[0] == 2
            copy = pickle.loads(pickle.dumps(rb))  # reattaches through the run directory
            assert len(copy) == 4
            copy.close()
        finally:
            rb.close()
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(timeout=90)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()


@pytest.mark.timeout(60)
def test_listen_on_tcp_for_writers_elsewhere(tmp_path):
    """``listen=``: the manager takes TCP connections (writers on other hosts that see the store); a copy of the
    handle joins over TCP."""
    rb = rbpipe.replay_buffer(tmp_path / "store", grpo_size=2, batch_size=2, listen=("127.0.0.1", 0))
    try:
        host, port = rb._spec.address
        assert host == "127.0.0.1" and port > 0
        copy = pickle.loads(pickle.dumps(rb))
        copy.extend(synthetic_steps(1, 2, seed=0))
        copy.close()
        assert len(rb) == rb.write_count == 2
    finally:
        rb.close()
