"""``rbpipe.replay_buffer`` handed to a Ray task on another (simulated) node, as torchrl's recipe hands its buffer
to ``LLMCollector.as_remote(...)`` and ``ray.remote(train)``: the task's copy reattaches to the same grouping and
store; what it writes, the driver reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tensordict import set_list_to_stack

import rbpipe
from rbpipe.torchrl_compat.ray_buffer import close_ray_replay_buffer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from text_model import chat_model, chat_tokenizer  # noqa: E402
from torchrl_handle import llm_stack  # noqa: E402
from torchrl_handle.llm_stack import by_member, interleaved, make_env, make_policy, synthetic_steps  # noqa: E402


def _write_then_sample(rb, steps):
    """In the Ray task: write half of each group, then sample what both sides wrote."""
    rb.extend(steps)
    batch = rb.sample()
    return len(rb), batch.get(("tokens", "full"), as_padded_tensor=True).shape[0]


@pytest.mark.timeout(180)
def test_handle_pickles_into_a_ray_task_on_another_node(ray_cluster, tmp_path):
    import ray
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the task's function travels by value
    with set_list_to_stack(True):
        rb = rbpipe.replay_buffer(tmp_path / "store", grpo_size=4, batch_size=4)
        try:
            driver, remote = synthetic_steps(3, 2, seed=0, collector=0), synthetic_steps(3, 2, seed=1, collector=1)
            rb.extend(driver)  # every group waits for the task's half
            task = ray.remote(num_cpus=0, resources={"node_b": 0.01})(_write_then_sample)
            rows, sampled = ray.get(task.remote(rb, remote), timeout=150)
            assert rows == len(rb) == rb.write_count == 12 and sampled == 4
            advantages = rb[:].get("advantage", as_padded_tensor=True).reshape(-1)
            assert torch.isfinite(advantages).all()
        finally:
            rb.close()


@pytest.mark.timeout(180)
def test_same_groups_and_advantages_as_torchrls_ray_replay_buffer(ray_cluster, tmp_path):
    """Issue 35's differential: the trajectories the recipe would hand to ``RayReplayBuffer(...,
    transform_factory=partial(MCAdvantage, ...))``, interleaved across groups, through that buffer and through
    the handle: the same rows, rewards, advantages and group counters."""
    from functools import partial

    from torchrl.data import LazyStackStorage
    from torchrl.data.replay_buffers.ray_buffer import RayReplayBuffer
    from torchrl.objectives.llm import MCAdvantage

    options = {"trajectory_return": "sum", "keep_return_bounds": (0.2, 0.8)}  # some groups dropped too
    stream = interleaved(synthetic_steps(5, 4, seed=3))
    with set_list_to_stack(True):
        reference = RayReplayBuffer(storage=partial(LazyStackStorage, 100), batch_size=4,
                                    transform_factory=partial(MCAdvantage, grpo_size=4, **options),
                                    remote_config={"num_cpus": 0})
        rb = rbpipe.replay_buffer(tmp_path / "store", grpo_size=4, batch_size=4, **options)
        try:
            for start in range(0, 20, 3):
                reference.extend(stream[start:start + 3])
                rb.extend(stream[start:start + 3])
            assert 0 < len(rb) == len(reference) < 20 and rb.write_count == reference.write_count
            want, got = by_member(reference[:]), by_member(rb[:])
            assert got.keys() == want.keys()
            for key, (reward, advantage) in want.items():
                assert got[key][0] == reward
                assert got[key][1] == pytest.approx(advantage, abs=1e-6)
        finally:
            rb.close()
            close_ray_replay_buffer(reference)  # a clean exit: a killed actor leaves 4 semaphores in /dev/shm



PROMPTS, REPEATS = 3, 2  # per collector: 3 prompts, each twice; a group (grpo_size 4) holds both collectors' halves


def _collector_env(collector: int):
    """The remote collector's env factory (runs in the Ray actor)."""
    set_list_to_stack(True).set()
    torch.set_num_threads(1)
    return make_env(collector, PROMPTS, REPEATS, chat_tokenizer())


def _collector_policy(seed: int):
    """The remote collector's policy factory: the tiny chat model, sampling seeded per collector."""
    torch.manual_seed(seed)
    return make_policy(chat_model(), chat_tokenizer())


@pytest.mark.timeout(240)
def test_llm_collectors_as_ray_actors_write_through_the_handle(ray_cluster, tmp_path):
    """The recipe's own wiring: ``LLMCollector.as_remote(...).remote(replay_buffer=rb, ...)``, one actor on each
    worker node, each running torchrl's ``ChatEnv`` + ``TransformersWrapper(generate=True)``; the handle pickled
    into both actors groups their halves in the driver's store."""
    from functools import partial

    import ray
    import ray.cloudpickle
    from torchrl.collectors.llm import LLMCollector

    for module in (sys.modules[__name__], llm_stack, sys.modules["text_model"]):
        ray.cloudpickle.register_pickle_by_value(module)  # the factories travel by value
    with set_list_to_stack(True):
        rb = rbpipe.replay_buffer(tmp_path / "store", grpo_size=2 * REPEATS, batch_size=4)
        collectors = []
        try:
            for c, node in enumerate(("node_b", "node_c")):
                remote = LLMCollector.as_remote({"num_cpus": 0, "resources": {node: 0.01}})
                collectors.append(remote.remote(
                    env=partial(_collector_env, c), policy_factory=partial(_collector_policy, 100 + c),
                    dialog_turns_per_batch=REPEATS, total_dialog_turns=PROMPTS * REPEATS, replay_buffer=rb))
            for _ in range(PROMPTS):  # one prompt's repeats per call; the buffer gets them, next() returns None
                assert ray.get([c.next.remote() for c in collectors], timeout=150) == [None, None]
            assert len(rb) == rb.write_count == 2 * PROMPTS * REPEATS
            assert rb.grouping_stats()["queued_trajectories"] == 0
            rows = rb[:]
            groups: dict[str, set[bool]] = {}
            for row in rows.unbind(0):
                groups.setdefault(row["query"], set()).add("collector 0" in row["text", "prompt"])
            assert len(groups) == PROMPTS and all(writers == {True, False} for writers in groups.values())
            assert torch.isfinite(rows.get("advantage", as_padded_tensor=True)).all()
        finally:
            for c in collectors:
                ray.get(c.shutdown.remote(), timeout=60)
                ray.kill(c)
            rb.close()
