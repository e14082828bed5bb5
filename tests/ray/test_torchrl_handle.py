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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torchrl_handle.llm_stack import synthetic_steps  # noqa: E402


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
