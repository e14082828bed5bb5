"""The GRPOLoss subclass on the real tiny model: accumulation, IS with a temperature mismatch, torchrl parity."""

from __future__ import annotations

import pytest
import torch
from tensordict import lazy_stack
from torchrl.objectives.llm import GRPOLoss

from rbpipe.loss import LossConfig, build_loss_batch, make_loss, train_step
from rbpipe.loss.batch import _response_mask
from rbpipe.policy import build_learner_actor, build_model, sample_responses
from rbpipe.schema import make_trajectory
from rbpipe.task import CopyFirstDigitTask


def rows(model, temperature: float = 1.0, prompts: int = 4, per_prompt: int = 4, equal_lengths: bool = False):
    task = CopyFirstDigitTask(seed=1, min_digits=3, max_digits=3) if equal_lengths else CopyFirstDigitTask(seed=1)
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(prompts):
        prompt = task.prompt(i)
        tokens, lps = sample_responses(model, prompt, per_prompt, temperature=temperature, generator=gen)
        for t, lp in zip(tokens, lps):
            traj = make_trajectory(group_id=i, prompt=prompt, response=t, rollout_log_probs=lp,
                                   reward=task.reward(prompt, t), collector_id=0, policy_version=0)
            traj.set("advantage", torch.randn(1, 1, generator=gen))
            out += list(traj.unbind(0))
    return lazy_stack(out)


@pytest.fixture(scope="module")
def setup():
    model = build_model()
    actor = build_learner_actor(model)
    return model, actor


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_gradient_accumulation_equals_one_batch(setup, mode):
    model, actor = setup
    batch = build_loss_batch(rows(model), actor=actor)
    loss = make_loss(actor, LossConfig(loss_agg_mode=mode))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    train_step(loss, opt, batch)
    one = grads(model)
    train_step(loss, opt, batch, micro_batches=3)
    for a, b in zip(one, grads(model)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_response_mask_matches_torchrl(setup):
    model, actor = setup
    batch = build_loss_batch(rows(model), actor=actor)
    td = batch.copy()
    advantage = td.get("advantage", as_padded_tensor=True, padding_side="left")
    _, _, _, mask = GRPOLoss(actor, masking_strategy="sft")._log_weight(td, adv_shape=advantage.shape[:-1])
    assert torch.equal(mask, _response_mask(batch))


def test_identical_settings_give_unit_token_weights(setup):
    model, actor = setup
    batch = build_loss_batch(rows(model, temperature=1.0), actor=actor)
    loss = make_loss(actor, LossConfig(rollout_is="token", rollout_is_threshold=(0.5, 2.0)))
    metrics = train_step(loss, torch.optim.SGD(model.parameters(), lr=0.0), batch)
    assert abs(metrics["is/weight_max"] - 1) < 1e-5 and abs(metrics["is/weight_min"] - 1) < 1e-5
    assert abs(metrics["mismatch/kl"]) < 1e-5


def test_temperature_mismatch_shows_in_metrics_and_weights(setup):
    model, actor = setup
    batch = build_loss_batch(rows(model, temperature=1.6), actor=actor)
    loss = make_loss(actor, LossConfig(rollout_is="token", rollout_is_mode="both", rollout_is_threshold=(0.8, 1.25)))
    metrics = train_step(loss, torch.optim.SGD(model.parameters(), lr=0.0), batch)
    assert metrics["mismatch/abs_logp_diff"] > 0.05 and metrics["mismatch/k3_kl"] > 1e-3
    assert metrics["is/weight_std"] > 0.01 and metrics["is/masked_frac"] > 0
    assert metrics["valid_tokens"] < _response_mask(batch).sum().item()  # masked tokens leave the count


def test_grpo_matches_torchrl_grpoloss_value_and_gradient(setup):
    """On equal-length rows. With ragged rows torchrl 0.14.1 pads ``advantage`` on the right but log-probs on
    the left, so shorter rows get pad advantages on response tokens; rbpipe pads both on the left."""
    model, actor = setup
    batch = build_loss_batch(rows(model, equal_lengths=True), actor=actor)
    ours = make_loss(actor, LossConfig())
    out = ours(batch)
    model.zero_grad()
    out["loss_objective"].backward()
    g_ours = grads(model)
    theirs = GRPOLoss(actor, masking_strategy="sft", entropy_bonus=False)(batch)
    model.zero_grad()
    theirs.loss_objective.backward()
    torch.testing.assert_close(out["loss_objective"], theirs.loss_objective.detach(), atol=1e-6, rtol=1e-5)
    for a, b in zip(g_ours, grads(model)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_kl_to_a_frozen_reference_is_zero_at_start(setup):
    import copy

    model, actor = setup
    ref_actor = build_learner_actor(copy.deepcopy(model).requires_grad_(False))
    batch = build_loss_batch(rows(model), actor=actor, ref_actor=ref_actor)
    for kind in ("k1", "abs", "k2", "k3"):
        loss = make_loss(actor, LossConfig(kl_type=kind, kl_coef=0.1), ref_actor=ref_actor)
        metrics = train_step(loss, torch.optim.SGD(model.parameters(), lr=0.0), batch)
        assert abs(metrics["kl_to_ref"]) < 1e-5
