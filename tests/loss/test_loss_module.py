"""The GRPOLoss subclass on the real tiny model: accumulation, IS with a temperature mismatch, torchrl parity."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tensordict import lazy_stack
from torchrl.objectives.llm import CISPOLoss, GRPOLoss

from rbpipe.demo.policy import build_learner_actor, build_model, sample_responses
from rbpipe.demo.task import CopyFirstDigitTask
from rbpipe.errors import ConfigError
from rbpipe.loss import (
    LossConfig,
    LossInputError,
    RbpipeCISPOLoss,
    RbpipeGRPOLoss,
    build_loss_batch,
    make_loss,
    one_update_loss,
    train_step,
)
from rbpipe.loss.batch import _response_mask, step_counts
from rbpipe.trajectory import make_trajectory


def rows(model, temperature: float = 1.0, prompts: int = 4, per_prompt: int = 4, equal_lengths: bool = False):
    """Stored-layout rows; unless ``equal_lengths``, prompts (2-5 digits) and responses (1-3 tokens) are ragged."""
    task = CopyFirstDigitTask(seed=1, min_digits=3, max_digits=3) if equal_lengths else CopyFirstDigitTask(seed=1)
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(prompts):
        prompt = task.prompt(i)
        tokens, lps = sample_responses(model, prompt, per_prompt, temperature=temperature, generator=gen)
        for j, (t, lp) in enumerate(zip(tokens, lps, strict=True)):
            if not equal_lengths:  # a collector stopping at EOS leaves shorter responses
                keep = 1 + (i + j) % 3
                t, lp = t[:keep], lp[:keep]
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


@pytest.fixture(scope="module")
def ref_actor(setup):
    return build_learner_actor(copy.deepcopy(setup[0]).requires_grad_(False))


AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
RICH = dict(rollout_is="token", rollout_is_mode="both", rollout_is_threshold=(0.9, 1.1), rollout_is_veto=(0.5, 2.0),
            kl_coef=0.1, kl_type="k1", entropy_coef=0.01)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("rich", [False, True], ids=["plain", "is+kl+entropy"])
def test_gradient_accumulation_equals_one_batch(setup, ref_actor, mode, rich):
    """k micro-batches (ragged rows, different padding widths) give the one-batch gradient, loss and metrics."""
    model, actor = setup
    batch = build_loss_batch(rows(model, temperature=1.6 if rich else 1.0), actor=actor, ref_actor=ref_actor)
    loss = make_loss(actor, LossConfig(loss_agg_mode=mode, **(RICH if rich else {})), ref_actor=ref_actor)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    m_one = train_step(loss, opt, batch)
    one = grads(model)
    m_parts = train_step(loss, opt, batch, micro_batches=3)
    assert any(g.abs().max() > 1e-4 for g in one)  # a real gradient, not zeros compared with zeros
    for a, b in zip(one, grads(model), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert m_one.keys() == m_parts.keys()
    for key, value in m_one.items():
        assert m_parts[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    if rich:
        assert 0 < m_one["valid_tokens"] < _response_mask(batch).sum().item()  # IS masking took tokens out


def test_the_learners_one_micro_batch_counts_equal_the_global_pass(setup):
    """The learner's configuration (lp_old from the current pass, token-level rollout IS on) with one
    micro-batch takes the step's counts from its own forward pass instead of a second masking pass: the
    counts, the gradient and every metric must equal those computed with the global pass (two micro-batches).
    (Masking needs lp_old before the pass, so the learner recomputes it and the masked case is the test above.)"""
    model, actor = setup
    batch = build_loss_batch(rows(model, temperature=1.6), actor=actor, recompute_old=False)
    loss = make_loss(actor, LossConfig(rollout_is="token", rollout_is_threshold=(0.5, 1.5)), old_from_current=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    one = train_step(loss, opt, batch)
    g_one = grads(model)
    two = train_step(loss, opt, batch, micro_batches=2)
    for a, b in zip(g_one, grads(model), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for key, value in one.items():
        assert two[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    counts = step_counts(loss, batch)
    assert (one["valid_tokens"], one["valid_sequences"]) == (counts["num_tokens"], counts["num_seqs"])
    assert one["valid_tokens"] == _response_mask(batch).sum().item()  # truncation keeps every token


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
    """Rollouts sampled at T=2 but evaluated by the learner at T=1: mismatch metrics fire, weights apply."""
    model, actor = setup
    batch = build_loss_batch(rows(model, temperature=2.0), actor=actor)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cfg = dict(rollout_is_mode="both", rollout_is_threshold=(0.9, 1.1))
    metrics = train_step(make_loss(actor, LossConfig(rollout_is="token", **cfg)), opt, batch)
    off = train_step(make_loss(actor, LossConfig(rollout_is=None, **cfg)), opt, batch)
    assert metrics["mismatch/abs_logp_diff"] > 0.02 and metrics["mismatch/k3_kl"] > 1e-4
    assert metrics["mismatch/training_ppl"] != pytest.approx(metrics["mismatch/rollout_ppl"], rel=1e-3)
    assert metrics["is/weight_std"] > 0.01 and metrics["is/masked_frac"] > 0
    assert metrics["valid_tokens"] < _response_mask(batch).sum().item()  # masked tokens leave the count
    assert off["valid_tokens"] == _response_mask(batch).sum().item() and off["is/masked_frac"] == 0
    assert off["mismatch/k3_kl"] == pytest.approx(metrics["mismatch/k3_kl"])  # reported even when IS is off
    assert metrics["loss_objective"] != pytest.approx(off["loss_objective"], rel=1e-4)


def _with(batch, key, fn):
    """A copy of a lazy-stacked batch with ``key`` replaced row by row by ``fn(row)``."""
    out = [row.clone() for row in batch.unbind(0)]
    for row in out:
        row.set(key, fn(row))
    return lazy_stack(out)


def _response_only(row, value):
    p = row.get(("tokens", "prompt")).numel()
    out = torch.zeros(row.get(("tokens", "full")).numel())
    out[p:] = value(row)[p:] if callable(value) else value
    return out


def test_is_weights_scale_the_policy_loss_only_not_the_kl(setup, ref_actor):
    model, actor = setup
    base = build_loss_batch(rows(model), actor=actor, ref_actor=ref_actor)
    # w = exp(lp_old - lp_roll) = 1.5 on every token; the reference sits 0.3 below lp_old (KL != 0)
    batch = _with(base, ("log_probs", "rollout_full"),
                  lambda r: _response_only(r, lambda r: r.get(("log_probs", "full")) - math.log(1.5)))
    batch = _with(batch, ("next", "ref_log_probs", "full"),
                  lambda r: _response_only(r, lambda r: r.get(("log_probs", "full")) - 0.3))
    kw = dict(kl_coef=0.1, kl_type="k2", rollout_is_threshold=(0.1, 10.0))
    with_is = make_loss(actor, LossConfig(rollout_is="token", **kw), ref_actor=ref_actor)(batch)
    without = make_loss(actor, LossConfig(rollout_is=None, **kw), ref_actor=ref_actor)(batch)
    assert without["loss_objective"].abs() > 1e-4
    torch.testing.assert_close(with_is["loss_objective"], 1.5 * without["loss_objective"])
    torch.testing.assert_close(with_is["loss_kl_to_ref"], without["loss_kl_to_ref"])
    torch.testing.assert_close(with_is["loss_kl_to_ref"], torch.tensor(0.1 * 0.5 * 0.3 ** 2))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_masked_sequences_leave_the_loss_and_the_count(setup, ref_actor, mode):
    """A vetoed row contributes nothing (policy, KL, count): the loss equals the loss of the other rows."""
    model, actor = setup
    batch = build_loss_batch(rows(model), actor=actor, ref_actor=ref_actor)
    batch = _with(batch, ("next", "ref_log_probs", "full"),
                  lambda r: _response_only(r, lambda r: r.get(("log_probs", "full")) + 0.2))
    poisoned = _with(batch, ("log_probs", "rollout_full"), lambda r: r.get(("log_probs", "full")).clone())
    poisoned[0].set(("log_probs", "rollout_full"), _response_only(poisoned[0], -9.0))  # w = e^(lp_old + 9): vetoed
    cfg = LossConfig(loss_agg_mode=mode, rollout_is="token", rollout_is_threshold=(0.1, 10.0),
                     rollout_is_veto=(0.01, 100.0), kl_coef=0.1, agg_norm=3.0)
    loss = make_loss(actor, cfg, ref_actor=ref_actor)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    full = train_step(loss, opt, poisoned)
    rest = train_step(loss, opt, batch[1:])
    assert full["is/veto_frac"] == pytest.approx(1 / 16) and full["valid_sequences"] == 15
    assert full["valid_tokens"] == rest["valid_tokens"]
    for key in ("loss_objective", "loss_kl_to_ref", "train/kl3", "entropy"):
        assert full[key] == pytest.approx(rest[key], rel=1e-5, abs=1e-7), key


def test_make_loss_picks_the_objective_class(setup, ref_actor):
    from torchrl.objectives.llm import DAPO, CISPOLoss

    _, actor = setup
    assert type(make_loss(actor, LossConfig())) is RbpipeGRPOLoss
    assert isinstance(make_loss(actor, LossConfig(loss="dapo")), DAPO)
    cispo = make_loss(actor, LossConfig(loss="cispo"))
    assert isinstance(cispo, RbpipeCISPOLoss) and isinstance(cispo, CISPOLoss)
    with pytest.raises(ConfigError, match="make_loss"):
        RbpipeCISPOLoss(actor, LossConfig(loss="grpo"))
    with pytest.raises(ConfigError, match="ref_actor"):
        make_loss(actor, LossConfig(kl_coef=0.1))
    assert not any(p is q for p in make_loss(actor, LossConfig(kl_coef=0.1), ref_actor=ref_actor).parameters()
                   for q in ref_actor.parameters())  # the frozen reference is not a trainable submodule


def test_cispo_module_keeps_gradient_of_clipped_tokens(setup):
    """Every token clipped high (r = e > 1.28): torchrl's CISPOLoss gives zero gradient, ours does not."""
    model, actor = setup
    base = build_loss_batch(rows(model, equal_lengths=True), actor=actor)
    batch = _with(base, ("log_probs", "full"),
                  lambda r: _response_only(r, lambda r: r.get(("log_probs", "full")) - 1.0))
    batch = _with(batch, "advantage", lambda r: torch.ones_like(r.get("advantage")))
    model.zero_grad()
    theirs = CISPOLoss(actor, masking_strategy="sft", clip_epsilon=(0.2, 0.28), entropy_bonus=False)(batch)
    theirs.loss_objective.backward()
    assert theirs.clip_fraction > 0 and all(p.grad is None or p.grad.abs().max() == 0 for p in model.parameters())
    model.zero_grad()
    ours = make_loss(actor, LossConfig(loss="cispo"))(batch)
    ours["loss_objective"].backward()
    assert ours["train/clip_frac_high"] == 1.0
    assert max(p.grad.abs().max() for p in model.parameters()) > 1e-4
    model.zero_grad()  # torchrl's own forward, driven through our subclass, picks up the fixed objective too
    GRPOLoss.forward(make_loss(actor, LossConfig(loss="cispo")), batch).loss_objective.backward()
    assert max(p.grad.abs().max() for p in model.parameters()) > 1e-4
    model.zero_grad()
    ours = make_loss(actor, LossConfig(loss="cispo"))(batch)
    ours["loss_objective"].backward()
    # d/dlp of -sg(clip(r)) * A * lp = -1.28 per token: the same gradient as 1.28 x GRPO's unclipped one (r=1)
    g_ours = grads(model)
    model.zero_grad()
    unclipped = base.copy().set("advantage", batch.get("advantage"))
    (1.28 * make_loss(actor, LossConfig())(unclipped)["loss_objective"]).backward()
    for a, b in zip(g_ours, grads(model), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_old_from_current_matches_recomputed_lp_old(setup):
    model, actor = setup
    r = rows(model)
    cfg = LossConfig(rollout_is="token", rollout_is_threshold=(0.5, 2.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    a = train_step(make_loss(actor, cfg), opt, build_loss_batch(r, actor=actor))
    ga = grads(model)
    lazy = build_loss_batch(r, actor=actor, recompute_old=False)
    b = train_step(make_loss(actor, cfg, old_from_current=True), opt, lazy)
    for x, y in zip(ga, grads(model), strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
    assert a["mismatch/kl"] == pytest.approx(b["mismatch/kl"], abs=1e-6)
    with pytest.raises(ConfigError, match="recompute_old"):
        masking = LossConfig(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold=(0.5, 2.0))
        train_step(make_loss(actor, masking, old_from_current=True), opt, lazy)



@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_a_one_update_learner_recomputes_lp_old_only_where_the_mask_needs_it(setup, mode):
    """``one_update_loss`` (the learner's and the benchmark loop's): ``lp_old`` from the current pass when rollout
    IS only truncates, a recomputed one when it masks; the step runs either way (it raised with masking before)."""
    model, actor = setup
    loss = one_update_loss(actor, LossConfig(rollout_is="token", rollout_is_mode=mode, rollout_is_threshold=(0, 5)))
    assert loss.old_from_current == (mode == "truncate")
    batch = build_loss_batch(rows(model), actor=actor, recompute_old=not loss.old_from_current)
    metrics = train_step(loss, torch.optim.SGD(model.parameters(), lr=0.0), batch)
    assert metrics["valid_tokens"] == _response_mask(batch).sum().item()  # same weights: nothing above the cap


def test_the_loss_leaves_its_input_as_it_was_and_the_same_value_either_way(setup):
    """torchrl's log-weight writes its current log-probs into the loss input; the loss removes them instead of
    copying the input (every row of a lazy stack). A locked input, or one that holds the key already, is copied:
    same value, input untouched."""
    from rbpipe.loss.module import CUR_LOG_PROB

    model, actor = setup
    loss = make_loss(actor, LossConfig(rollout_is="token"), old_from_current=True)
    batch = build_loss_batch(rows(model), actor=actor, recompute_old=False)
    keys = set(batch.keys(True, True))
    value = loss(batch)["loss_objective"].detach()
    assert set(batch.keys(True, True)) == keys and CUR_LOG_PROB not in batch.keys()
    batch.lock_()
    torch.testing.assert_close(loss(batch)["loss_objective"].detach(), value)
    batch.unlock_()
    marker = [torch.full((row.get(("tokens", "full")).shape[-1],), 7.0) for row in batch.unbind(0)]
    for row, m in zip(batch.tensordicts, marker, strict=True):
        row.set(CUR_LOG_PROB, m)
    torch.testing.assert_close(loss(batch)["loss_objective"].detach(), value)
    assert all(torch.equal(row.get(CUR_LOG_PROB), m) for row, m in zip(batch.tensordicts, marker, strict=True))


def test_missing_inputs_are_clear_errors(setup):
    model, actor = setup
    batch = build_loss_batch(rows(model), actor=actor)
    with pytest.raises(LossInputError, match="ref_actor"):
        make_loss(actor, LossConfig(kl_coef=0.1), ref_actor=actor)(batch)
    bad = rows(model).exclude("advantage")
    with pytest.raises(LossInputError, match="advantage"):
        build_loss_batch(bad, actor=actor)


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
    for a, b in zip(g_ours, grads(model), strict=True):
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
