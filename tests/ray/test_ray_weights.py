"""The Ray engine's weights: a publish puts the parameters into Ray's object store without concatenating them
into one vector first (views of the parameters, pickled out of band by Ray), and readers load exactly what a
flat float32 vector gave them (a bfloat16 parameter included, cast to each reader's dtype)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rbpipe.demo.policy import flat_parameters, load_flat_parameters
from rbpipe.service.ray.coordinator import load_parameter_buffers, parameter_buffers


def _model(dtype=None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 3, dtype=torch.bfloat16))
    return model if dtype is None else model.to(dtype)


def _blank(dtype=None) -> torch.nn.Module:
    model = _model(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def test_the_buffers_are_views_of_the_parameters_and_load_like_the_flat_vector():
    model = _model()
    dtypes, arrays = parameter_buffers(model)
    assert dtypes == ["float32", "float32", "bfloat16", "bfloat16"]
    for p, array in zip(model.parameters(), arrays, strict=True):  # no copy: the parameters' own bytes
        assert array.dtype == np.uint8 and array.nbytes == p.numel() * p.element_size()
        assert array.__array_interface__["data"][0] == p.data_ptr()
    for dtype in (None, torch.float32, torch.bfloat16):  # readers in the learner's dtypes, float32, bfloat16
        from_buffers, from_flat = _blank(dtype), _blank(dtype)
        load_parameter_buffers(from_buffers, (dtypes, [a.copy() for a in arrays]))
        load_flat_parameters(from_flat, flat_parameters(model))
        for a, b in zip(from_buffers.parameters(), from_flat.parameters(), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    with pytest.raises(ValueError, match="hold 2 parameters, the model has 4"):
        load_parameter_buffers(_blank(), (dtypes[:2], arrays[:2]))


@pytest.mark.timeout(180)
def test_a_publish_concatenates_nothing_and_a_reader_loads_it(ray_cluster, tmp_path, monkeypatch):
    import ray

    from rbpipe.service.ray import RayManager, RayWeights

    manager = RayManager.start(shards=1, ttl_s=5.0, log_dir=str(tmp_path), prefix="weights-")
    try:
        model = _model()
        numel = sum(p.numel() for p in model.parameters())
        publisher = RayWeights(manager.coordinator_actor, numel)
        with monkeypatch.context() as m:
            m.setattr(torch, "cat", lambda *a, **k: pytest.fail("publish concatenated the parameters"))
            publisher.publish(model, version=3, learner_step=5)
        with torch.no_grad():  # the learner's next step: the published version keeps its values
            for p in model.parameters():
                p.add_(1)
        reader = RayWeights(manager.coordinator_actor, numel)
        assert (reader.version, reader.learner_step) == (3, 5)
        for dtype in (None, torch.float32):
            loaded = _blank(dtype)
            assert reader.load_into(loaded) == 3
            for a, b in zip(loaded.parameters(), _model(dtype).parameters(), strict=True):
                assert torch.equal(a, b)
        # a flat float32 vector (what publishers put before) still loads
        ref = ray.put(flat_parameters(_model()))
        ray.get(manager.coordinator_actor.set_weights.remote(4, 6, [ref]))
        loaded = _blank()
        assert reader.load_into(loaded) == 4
        for a, b in zip(loaded.parameters(), _model().parameters(), strict=True):
            assert torch.equal(a, b)
    finally:
        manager.shutdown()
