"""Invariants of the pure functions (hypothesis) and the metrics formulas evaluated directly."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, lazy_stack

from rbpipe.errors import ConfigError
from rbpipe.loss import (
    LossConfig,
    MetricsAccumulator,
    aggregate,
    kl_penalty,
    policy_loss,
    rollout_importance_weights,
    train_policy_metrics,
)
from rbpipe.loss.batch import row_sums

AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@st.composite
def batches(draw):
    """``(lp, lp_old, lp_roll, adv, mask)`` with random shapes, values and masks (every row has a valid token)."""
    b, t = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    lp = -torch.rand(b, t, generator=gen) * 3
    lp_old = lp + 0.5 * torch.randn(b, t, generator=gen)
    lp_roll = lp_old + 0.5 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, 1, generator=gen).expand(b, t)
    mask = torch.rand(b, t, generator=gen) > 0.4
    mask[:, -1] = True
    return lp, lp_old, lp_roll, adv, mask


def _garbage(x, mask):
    """``x`` with every masked position replaced by junk (large, inf, NaN)."""
    junk = torch.tensor([1e6, -1e6, math.inf, -math.inf, math.nan]).repeat(x.numel())[: x.numel()].view_as(x)
    return torch.where(mask, x, junk)


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(["grpo", "dapo", "cispo"]), st.sampled_from(AGG_MODES),
       st.sampled_from([None, 3.0]))
def test_masked_positions_change_neither_loss_nor_gradient(data, kind, mode, dual):
    lp, lp_old, _, adv, mask = data
    dual = None if kind == "cispo" else dual

    def run(lp_in, old, a):
        lp_in = lp_in.clone().requires_grad_(True)
        out = aggregate(policy_loss(lp_in - old, a, kind=kind, eps_low=0.2, eps_high=0.28, dual_clip=dual), mask, mode)
        out.backward()
        return out.detach(), torch.where(mask, lp_in.grad, 0.0)

    clean = run(lp, lp_old, adv)
    dirty = run(_garbage(lp, mask), _garbage(lp_old, mask), _garbage(adv, mask))
    assert torch.isfinite(clean[0]) and torch.equal(clean[0], dirty[0])
    assert torch.equal(clean[1], dirty[1])


@settings(max_examples=30, deadline=None)
@given(batches(), st.sampled_from(["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]))
def test_kl_mean_is_not_diluted_by_padding(data, kind):
    lp, _, ref, _, mask = data
    direct = kl_penalty(lp[mask], ref[mask], kind).mean()
    padded = aggregate(kl_penalty(_garbage(lp, mask), _garbage(ref, mask), kind), mask, "token-mean")
    torch.testing.assert_close(padded, direct)


@settings(max_examples=30, deadline=None)
@given(batches(), st.sampled_from(["token", "sequence", "geometric"]), st.sampled_from(["truncate", "mask", "both"]))
def test_is_weights_and_metrics_ignore_padding(data, level, mode):
    _, old, roll, _, mask = data
    kw = dict(level=level, mode=mode, lower=0.5, upper=2.0, veto=(0.05, 20.0))
    w1, m1, met1 = rollout_importance_weights(old, roll, mask, **kw)
    w2, m2, met2 = rollout_importance_weights(_garbage(old, mask), _garbage(roll, mask), mask, **kw)
    assert torch.equal(w1, w2) and torch.equal(m1, m2) and not (m1 & ~mask).any()
    assert (w1[~m1] == 0).all() and (w1[m1] > 0).all()
    assert met1.keys() == met2.keys()
    for k in met1:
        assert met1[k] == pytest.approx(met2[k], nan_ok=True), k


def test_is_metrics_match_the_spec_formulas():
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.2, -3.0, 0.0, 0.0]])
    roll = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-0.1, -2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    _, new_mask, m = rollout_importance_weights(old, roll, mask, level="token", mode="mask", lower=0.5, upper=1.5)
    lo, lr = old[mask].double(), roll[mask].double()
    log_w = lo - lr
    w = log_w.exp()
    n = log_w.numel()
    assert m["mismatch/kl"] == pytest.approx(float((lr - lo).mean()))
    assert m["mismatch/k3_kl"] == pytest.approx(float((w - log_w - 1).mean()))
    assert m["mismatch/abs_logp_diff"] == pytest.approx(float(log_w.abs().mean()))
    ppl_train = [math.exp(-float(old[i][mask[i]].double().mean())) for i in range(2)]
    ppl_roll = [math.exp(-float(roll[i][mask[i]].double().mean())) for i in range(2)]
    assert m["mismatch/training_ppl"] == pytest.approx(sum(ppl_train) / 2)
    assert m["mismatch/rollout_ppl"] == pytest.approx(sum(ppl_roll) / 2)
    assert m["is/weight_mean"] == pytest.approx(float(w.mean()))
    assert m["is/weight_max"] == pytest.approx(float(w.max())) and m["is/weight_min"] == pytest.approx(float(w.min()))
    assert m["is/weight_std"] == pytest.approx(float(w.std()))
    assert m["is/ess"] == pytest.approx(float(w.sum() ** 2 / (n * (w ** 2).sum())))
    assert m["is/frac_above_upper"] == pytest.approx(float((w > 1.5).double().mean()))
    assert m["is/frac_below_lower"] == pytest.approx(float((w < 0.5).double().mean()))
    assert m["is/masked_frac"] == pytest.approx(float(((w < 0.5) | (w > 1.5)).double().mean()))
    assert m["is/masked_frac"] > 0 and new_mask.sum() < mask.sum()


def test_train_policy_metrics_match_the_spec_formulas():
    log_ratio = torch.tensor([[0.5, -0.4, 0.1, 9.0], [-0.05, 0.3, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    acc = MetricsAccumulator()
    train_policy_metrics(log_ratio, mask, eps_low=0.2, eps_high=0.28, accumulator=acc)
    m = acc.result()
    lr = log_ratio[mask].double()
    r = lr.exp()
    assert m["train/abs_ratio_minus_1"] == pytest.approx(float((r - 1).abs().mean()))
    assert m["train/kl1"] == pytest.approx(float((-lr).mean()))
    assert m["train/kl3"] == pytest.approx(float((r - 1 - lr).mean()))
    assert m["train/clip_frac_low"] == pytest.approx(1 / 5) and m["train/clip_frac_high"] == pytest.approx(2 / 5)
    assert m["train/ratio_max"] == pytest.approx(math.exp(0.5))
    assert m["train/ratio_min"] == pytest.approx(math.exp(-0.4))


@settings(max_examples=25, deadline=None)
@given(batches(), st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_accumulator_over_any_split_equals_one_batch(data, cuts):
    """Sums/counts added, max/min taken, then divided: any row split gives the single-batch metrics."""
    _, old, roll, _, mask = data
    kw = dict(level="geometric", mode="both", lower=0.7, upper=1.4, veto=(0.1, 10.0))
    whole = MetricsAccumulator()
    rollout_importance_weights(old, roll, mask, **kw, accumulator=whole)
    train_policy_metrics(old - roll, mask, eps_low=0.2, eps_high=0.2, accumulator=whole)
    parts, a = MetricsAccumulator(), 0
    for c in cuts + [old.shape[0]]:
        b = min(a + c, old.shape[0])
        if b > a:
            part = MetricsAccumulator()
            rollout_importance_weights(old[a:b], roll[a:b], mask[a:b], **kw, accumulator=part)
            train_policy_metrics(old[a:b] - roll[a:b], mask[a:b], eps_low=0.2, eps_high=0.2, accumulator=part)
            parts.merge(part)
        a = b
    one, merged = whole.result(), parts.result()
    assert one.keys() == merged.keys()
    for k, v in one.items():
        # float32 sums in another order: rounding of about eps32 (1.2e-7) times the summands (|log w| <= ~10)
        assert merged[k] == pytest.approx(v, rel=1e-6, abs=1e-6, nan_ok=True), k


def test_both_mode_masks_then_clamps_and_sequence_level_masks_whole_rows():
    old = torch.zeros(2, 3)
    roll = torch.tensor([[-0.3, 0.0, 0.0], [-0.05, -0.05, 0.0]])  # row 0 sum log_w = 0.3, row 1 = 0.1
    mask = torch.ones(2, 3, dtype=torch.bool)
    w, m, _ = rollout_importance_weights(old, roll, mask, level="sequence", mode="mask", lower=0.9, upper=1.2)
    assert not m[0].any() and m[1].all() and (w[0] == 0).all()
    torch.testing.assert_close(w[1], torch.full((3,), math.exp(0.1)))
    w, m, _ = rollout_importance_weights(old, roll, mask, level="token", mode="both", lower=0.9, upper=1.2)
    assert not m[0, 0] and m[0, 1:].all()
    torch.testing.assert_close(w[m], torch.exp(-roll)[m])  # kept tokens are inside the bounds: clamp is a no-op
    w_t, m_t, _ = rollout_importance_weights(old, roll, mask, level="token", mode="truncate", lower=0.9, upper=1.2)
    assert m_t.all() and w_t[0, 0] == pytest.approx(1.2)  # truncate keeps the token, clamped
    w, m, met = rollout_importance_weights(old, roll, mask, level="token", mode="truncate", lower=0.1, upper=10.0,
                                           veto=(0.0, 1.2))  # veto lower 0: no lower veto
    assert not m[0].any() and m[1].all() and met["is/veto_frac"] == 0.5


def test_aggregation_aliases_and_dual_clip_default():
    x, mask = torch.randn(3, 4), torch.rand(3, 4) > 0.3
    for mode in AGG_MODES:
        assert torch.equal(aggregate(x, mask, mode.replace("-", "_")), aggregate(x, mask, mode))
    assert LossConfig(dual_clip=True).dual_clip == 3.0
    assert LossConfig(loss_agg_mode="token_mean").loss_agg_mode == "token-mean"


@pytest.mark.parametrize("kwargs, match", [
    (dict(rollout_is="token", rollout_is_threshold=(0.5, 2.0), rollout_is_veto=(3.0, 0.1)), "lower first"),
    (dict(rollout_is="token", rollout_is_threshold=None), "threshold"),
    (dict(rollout_is="tokens"), "--rollout-is"),
    (dict(rollout_is_mode="clip"), "--rollout-is-mode"),
    (dict(kl_type="k4"), "--kl-type"),
    (dict(kl_coef=-1.0), "--kl-coef"),
    (dict(entropy_coef=-0.1), "entropy_coef"),
    (dict(agg_norm=0.0), "agg_norm"),
    (dict(loss_agg_mode="mean"), "--loss-agg-mode"),
    (dict(eps_low=1.5), "eps_low"),
    (dict(dual_clip=0.5), "dual-clip"),
    (dict(rollout_is_threshold=(0.5,)), "pair"),
])
def test_impossible_configs_name_the_option(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LossConfig(**kwargs)


def test_one_sided_threshold_is_a_config_error():
    with pytest.raises(ConfigError, match="both"):
        rollout_importance_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
                                   level="token", mode="truncate", lower=0.5, upper=None)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 7), min_size=1, max_size=12), seed=st.integers(0, 2**16))
def test_row_sums_equal_each_rows_own_sum_for_lazy_stacks_and_stored_columns(lengths, seed):
    """The learner's group fingerprints use these sums: a lazy stack of rows (what the learner samples) and a
    stored ragged column (one nested tensor) must both give exactly each row's sum, empty rows included."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(-50, 50, (n,), generator=gen) for n in lengths]
    expected = torch.tensor([int(r.sum()) for r in rows], dtype=torch.int64)
    lazy = lazy_stack([TensorDict({"tokens": r}) for r in rows])
    column = TensorDict({"tokens": torch.nested.nested_tensor(rows, layout=torch.jagged)}, batch_size=[len(rows)])
    assert torch.equal(row_sums(lazy, "tokens"), expected)
    assert torch.equal(row_sums(column, "tokens"), expected)
