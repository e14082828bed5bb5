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
