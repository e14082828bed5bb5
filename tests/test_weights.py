"""Weight publishing crosses a real ``multiprocess`` spawn boundary."""

from __future__ import annotations

import multiprocess
import pytest
import torch

from rbpipe.demo.policy import PolicyConfig, build_model, flat_parameters
from rbpipe.service.weights import SharedWeights


def _reader(weights: SharedWeights, out) -> None:
    model = build_model(PolicyConfig(seed=123))  # different init: must be overwritten by the load
    version = weights.load_into(model)
    out.put((version, flat_parameters(model).sum().item()))


@pytest.mark.timeout(120)
def test_child_process_sees_published_weights(tmp_path):
    model = build_model(PolicyConfig(seed=0))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    flat = flat_parameters(model)
    weights = SharedWeights(tmp_path / "w", flat.numel(), create=True)
    weights.publish(model, version=7, learner_step=7)
    ctx = multiprocess.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_reader, args=(weights, q))
    p.start()
    try:
        version, total = q.get(timeout=100)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert version == 7
    assert total == pytest.approx(flat.sum().item(), rel=1e-6)


def test_torn_read_is_retried_until_consistent(tmp_path):
    model = build_model()
    weights = SharedWeights(tmp_path / "w", flat_parameters(model).numel(), create=True)
    weights.publish(model, version=1)
    weights._header[0] += 1  # a writer "in the middle" of a publish
    with pytest.raises(TimeoutError):
        weights.load_into(model, timeout=0.05)
    weights._header[0] += 1
    assert weights.load_into(model) == 1


def _shared_resident_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssShmem:"))


def test_publishing_keeps_the_vector_out_of_the_publishers_resident_memory(tmp_path):
    """Issue 38's learner memory: a publish writes through the file, so the learner's resident set does not hold
    the shared vector (40 MB here; 540 MB for SmolLM2-135M) for the rest of the run, and what a reader maps
    back is exactly the model's parameters, in order, as float32 (a bf16 parameter converted)."""
    model = torch.nn.Sequential(torch.nn.Linear(1000, 10_000), torch.nn.Linear(10_000, 1, dtype=torch.bfloat16))
    flat = flat_parameters(model)
    weights = SharedWeights(tmp_path / "w", flat.numel(), create=True)
    before = _shared_resident_kb()
    weights.publish(model, version=3, learner_step=5)
    assert _shared_resident_kb() - before < flat.numel() * 4 // 1024 // 10  # < 10% of the 40 MB vector
    reader = SharedWeights(tmp_path / "w", flat.numel())
    assert (reader.version, reader.learner_step) == (3, 5)
    assert torch.equal(reader._flat, flat)
    small = SharedWeights(tmp_path / "small", 10, create=True)
    with pytest.raises(ValueError, match="holds 10"):
        small.publish(model, version=1)
    assert small._header[0] % 2 == 0  # not left "writing"
