"""Each formula of the loss spec, on hand-made tensors, against the spec evaluated directly."""

from __future__ import annotations

import math

import pytest
import torch

from rbpipe.errors import ConfigError
from rbpipe.loss import LossConfig, MetricsAccumulator, aggregate, kl_penalty, policy_loss, rollout_importance_weights

torch.manual_seed(0)
LP = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.3, -1.2, 0.0, 0.0]])
LP_OLD = torch.tensor([[-1.2, -0.1, -2.0, 0.0], [-0.9, -1.0, 0.0, 0.0]])
ADV = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, -2.0, -2.0]])
MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])


def spec_ppo(lp, lp_old, a, lo, hi):
    r = math.exp(max(-20, min(20, lp - lp_old)))
    return max(-r * a, -min(max(r, 1 - lo), 1 + hi) * a)


@pytest.mark.parametrize("kind, lo, hi", [("grpo", 0.2, 0.2), ("dapo", 0.2, 0.28), ("grpo", 0.1, 0.3)])
def test_ppo_clip_objectives_match_the_spec(kind, lo, hi):
    out = policy_loss(LP - LP_OLD, ADV, kind=kind, eps_low=lo, eps_high=hi)
    for i in range(2):
        for t in range(4):
            expected = spec_ppo(LP[i, t].item(), LP_OLD[i, t].item(), ADV[i, t].item(), lo, hi)
            assert out[i, t].item() == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_dual_clip_bounds_negative_advantages_at_c_times_minus_a():
    log_ratio = torch.tensor([[3.0, 3.0, -3.0]])
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    plain = policy_loss(log_ratio, adv, kind="grpo", eps_low=0.2, eps_high=0.2)
    dual = policy_loss(log_ratio, adv, kind="grpo", eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    assert plain[0, 0].item() == pytest.approx(math.exp(3.0))  # unbounded without dual-clip
    assert dual[0, 0].item() == pytest.approx(3.0)  # min(L, -c*A) = 3
    assert dual[0, 1] == plain[0, 1] and dual[0, 2] == plain[0, 2]


def test_cispo_clipped_tokens_keep_their_gradient():
    lp = torch.tensor([[-0.1, -3.0]], requires_grad=True)  # token 0: r = e^2.9 (clipped); token 1: r = 1
    lp_old = torch.tensor([[-3.0, -3.0]])
    adv = torch.tensor([[1.0, 1.0]])
    policy_loss(lp - lp_old, adv, kind="cispo", eps_low=0.2, eps_high=0.28).sum().backward()
    # spec: d/dlp of -sg(clip(r)) * A * lp = -clip(r) * A
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.28, -1.0]]))
    # torchrl 0.14.1's CISPO objective (-clip(r) * A, no stop-gradient) gives the clipped token none
    lp2 = lp.detach().clone().requires_grad_(True)
    (-(lp2 - lp_old).clamp(math.log(0.8), math.log(1.28)).exp() * adv).sum().backward()
    assert lp2.grad[0, 0].item() == 0.0


@pytest.mark.parametrize("kind, alias", [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")])
def test_kl_types_and_aliases(kind, alias):
    ref = torch.tensor([[-1.1, -0.4, -3.0, 0.0], [-0.2, -1.0, 0.0, 0.0]])
    d = LP - ref
    expected = {"k1": d, "k2": 0.5 * d ** 2,
                "k3": (torch.exp((-d).clamp(-20, 20)) - (-d).clamp(-20, 20) - 1).clamp(-10, 10)}[kind]
    torch.testing.assert_close(kl_penalty(LP, ref, kind), expected)
    assert torch.equal(kl_penalty(LP, ref, kind), kl_penalty(LP, ref, alias))
    torch.testing.assert_close(kl_penalty(LP, ref, "abs"), d.abs())


def test_aggregation_modes_match_the_spec_and_ignore_padding():
    x = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 5.0, 99.0, 99.0]])
    assert aggregate(x, MASK, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4 + 5) / 5)
    assert aggregate(x, MASK, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.5) / 2)
    assert aggregate(x, MASK, "seq-mean-token-sum").item() == pytest.approx((6 + 9) / 2)
    assert aggregate(x, MASK, "seq-mean-token-sum-norm").item() == pytest.approx(15 / 4)
    assert aggregate(x, MASK, "seq-mean-token-sum-norm", norm=10).item() == pytest.approx(1.5)
    padded = torch.where(MASK, x, torch.full_like(x, -1e6))
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert aggregate(padded, MASK, mode) == aggregate(x, MASK, mode)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batches_with_global_counts_equal_one_batch(mode):
    x = torch.randn(6, 5, requires_grad=True)
    mask = torch.rand(6, 5) > 0.3
    mask[:, 0] = True
    full = aggregate(x, mask, mode)
    g_full, = torch.autograd.grad(full, x)
    n_tok, n_seq = mask.sum().item(), mask.any(-1).sum().item()
    parts = sum(aggregate(x[a:b], mask[a:b], mode, num_tokens=n_tok, num_seqs=n_seq, norm=5)
                for a, b in ((0, 2), (2, 5), (5, 6)))
    g_parts, = torch.autograd.grad(parts, x)
    torch.testing.assert_close(parts, full)
    torch.testing.assert_close(g_parts, g_full, atol=1e-6, rtol=0)


def test_rollout_is_levels_modes_and_veto():
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    roll = torch.tensor([[0.0, -1.0, 0.0], [0.5, 0.5, 0.0]])  # log_w = old - roll
    mask = torch.tensor([[True, True, False], [True, True, True]])
    w, m, metrics = rollout_importance_weights(old, roll, mask, level="token", mode="truncate", lower=0.5, upper=2.0)
    torch.testing.assert_close(w[0, :2], torch.tensor([1.0, 2.0]))  # e^1 clamped to 2
    assert w[0, 2] == 0 and torch.equal(m, mask)
    w, m, _ = rollout_importance_weights(old, roll, mask, level="token", mode="mask", lower=0.5, upper=2.0)
    assert not m[0, 1] and m[0, 0] and w[0, 1] == 0  # e^1 > 2: masked, not clamped
    w, m, _ = rollout_importance_weights(old, roll, mask, level="sequence", mode="truncate", lower=0.1, upper=10.0)
    torch.testing.assert_close(w[0, :2], torch.full((2,), math.e))  # exp(sum log_w) = e
    torch.testing.assert_close(w[1], torch.full((3,), math.exp(-1.0)))
    w, m, _ = rollout_importance_weights(old, roll, mask, level="geometric", mode="truncate", lower=0.1, upper=10.0)
    torch.testing.assert_close(w[0, :2], torch.full((2,), math.exp(0.5)))
    w, m, metrics = rollout_importance_weights(old, roll, mask, level="token", mode="truncate", lower=0.1,
                                               upper=10.0, veto=(0.5, 2.0))
    assert not m[0].any() and m[1].all() and metrics["is/veto_frac"] == 0.5
    assert metrics["mismatch/kl"] == pytest.approx((0 + -1 + 0.5 + 0.5 + 0) / 5)


def test_disabled_is_keeps_weights_at_one_but_reports_mismatch():
    old, roll = torch.zeros(1, 3), torch.tensor([[-0.5, 0.0, 0.2]])
    w, m, metrics = rollout_importance_weights(old, roll, torch.ones(1, 3, dtype=torch.bool), level=None)
    assert torch.equal(w, torch.ones(1, 3)) and m.all()
    assert metrics["mismatch/abs_logp_diff"] == pytest.approx(0.7 / 3)


@pytest.mark.parametrize("bounds", [(2.0, 0.5), (1.0, 1.0)])
def test_thresholds_in_the_wrong_order_are_a_clear_error(bounds):
    with pytest.raises(ConfigError, match="lower first"):
        rollout_importance_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
                                   level="token", lower=bounds[0], upper=bounds[1])
    with pytest.raises(ConfigError):
        LossConfig(rollout_is="token", rollout_is_threshold=bounds)


def test_impossible_loss_configs():
    with pytest.raises(ConfigError, match="dual-clip"):
        LossConfig(loss="cispo", dual_clip=3.0)
    with pytest.raises(ConfigError, match="--loss"):
        LossConfig(loss="ppo")
    assert (LossConfig(loss="dapo").eps_low, LossConfig(loss="dapo").eps_high) == (0.2, 0.28)


def test_metrics_reduced_over_micro_batches_equal_the_single_batch_value():
    old = torch.randn(8, 6)
    roll = old + 0.3 * torch.randn(8, 6)
    mask = torch.rand(8, 6) > 0.2
    _, _, single = rollout_importance_weights(old, roll, mask, level="token", lower=0.5, upper=2.0)
    acc = MetricsAccumulator()
    for a, b in ((0, 3), (3, 4), (4, 8)):
        part = MetricsAccumulator()
        rollout_importance_weights(old[a:b], roll[a:b], mask[a:b], level="token", lower=0.5, upper=2.0,
                                   accumulator=part)
        acc.merge(part)
    merged = acc.result()
    for key, value in single.items():
        assert merged[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
