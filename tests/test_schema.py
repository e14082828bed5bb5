"""Bad trajectories are rejected with an error that names the problem and the fix."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rbpipe.errors import BadTrajectoryError
from rbpipe.trajectory import make_trajectory, validate_trajectory


def good(**overrides):
    kwargs = dict(group_id=3, prompt=torch.tensor([2, 5, 6, 3]), response=torch.tensor([5, 1, 1]),
                  rollout_log_probs=torch.tensor([-0.1, -2.0, -2.0]), reward=1.0, collector_id=0,
                  policy_version=0)
    kwargs.update(overrides)
    return make_trajectory(**kwargs)


def test_a_good_trajectory_passes():
    validate_trajectory(good())


@settings(max_examples=30, deadline=None)
@given(prompt_len=st.integers(0, 6), response_len=st.integers(0, 6), reward=st.floats(-10, 10),
       as_2d=st.booleans())
def test_make_trajectory_builds_what_the_checked_tensordict_constructor_accepts(prompt_len, response_len, reward,
                                                                                as_2d):
    """``make_trajectory`` skips the constructor's checks (every leaf is [1, ...] by construction): rebuilding
    its output with the checked constructor must accept it and give the same trajectory."""
    prompt = torch.arange(prompt_len, dtype=torch.int32)
    response = torch.arange(response_len)
    out = make_trajectory(group_id=7, prompt=prompt.reshape(1, -1) if as_2d else prompt, response=response,
                          rollout_log_probs=torch.zeros(response_len, dtype=torch.float64), reward=reward,
                          collector_id=1, policy_version=4)
    checked = TensorDict(out.to_dict(), batch_size=[1])
    assert out.batch_size == checked.batch_size == torch.Size([1])
    assert set(out.keys(True, True)) == set(checked.keys(True, True))
    assert all(out.get(k).dtype == checked.get(k).dtype and out.get(k).shape[0] == 1 for k in checked.keys(True, True))
    assert (out == checked).all()
    assert out["tokens", "prompt"].dtype == torch.int64 and out["log_probs", "rollout"].dtype == torch.float32
    validate_trajectory(out)


def test_unfinished_trajectory():
    td = good()
    td["next", "done"] = torch.zeros(1, 1, dtype=torch.bool)
    with pytest.raises(BadTrajectoryError, match="unfinished"):
        validate_trajectory(td)


def test_missing_and_misspelled_keys_are_named():
    td = good()
    td.rename_key_(("next", "reward"), ("next", "rewrad"))
    with pytest.raises(BadTrajectoryError, match=r"missing required key\(s\) next.reward.*next.rewrad"):
        validate_trajectory(td)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward(value):
    with pytest.raises(BadTrajectoryError, match="not finite"):
        validate_trajectory(good(reward=value))


# The checks take a numpy fast path for plain CPU tensors and torch's ops for the rest (bfloat16, which numpy
# lacks; tensors that require grad): both must reject the same input.
_REWARD_FORMS = {
    "float32": lambda r: r,
    "float16": lambda r: r.half(),
    "float64": lambda r: r.double(),
    "bfloat16": lambda r: r.bfloat16(),
    "requires_grad": lambda r: r.clone().requires_grad_(),
    "non_contiguous": lambda r: r.expand(1, 2)[:, :1],
}


@pytest.mark.parametrize("form", sorted(_REWARD_FORMS))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.5])
def test_reward_checks_agree_whatever_the_tensor_form(form, value):
    td = good()
    td["next", "reward"] = _REWARD_FORMS[form](torch.full((1, 1), value))
    if value == 0.5:
        validate_trajectory(td)
    else:
        with pytest.raises(BadTrajectoryError, match="not finite"):
            validate_trajectory(td)


@pytest.mark.parametrize("done_form", ["bool", "uint8", "float32"])
def test_unfinished_trajectory_is_caught_for_any_done_dtype(done_form):
    td = good()
    td["next", "done"] = torch.zeros(1, 1, dtype=getattr(torch, done_form))
    with pytest.raises(BadTrajectoryError, match="unfinished"):
        validate_trajectory(td)
    td["next", "done"] = torch.ones(1, 1, dtype=getattr(torch, done_form))
    validate_trajectory(td)


def test_integer_reward_dtype():
    td = good()
    td["next", "reward"] = torch.ones(1, 1, dtype=torch.int64)
    with pytest.raises(BadTrajectoryError, match="floating point"):
        validate_trajectory(td)


def test_not_a_tensordict():
    with pytest.raises(BadTrajectoryError, match="TensorDict"):
        validate_trajectory({"reward": 1.0})
