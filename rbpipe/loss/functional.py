"""The learner's formulas (``shared LOSS_SPEC``) as tensor-in, tensor-out functions.

Shapes are ``[batch, tokens]``; ``mask`` is boolean of the same shape and marks the response tokens that
count. Every function leaves masked positions out of every value it returns.
"""

from __future__ import annotations

import math

import torch

from rbpipe.errors import ConfigError
from rbpipe.loss.metrics import MetricsAccumulator

POLICY_KINDS = ("grpo", "dapo", "cispo")
KL_KINDS = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
AGG_ALIASES = {m.replace("-", "_"): m for m in AGG_MODES}
IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask", "both")


def policy_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, *, kind: str, eps_low: float, eps_high: float,
                dual_clip: float | None = None) -> torch.Tensor:
    """Per-token policy loss. ``log_ratio = lp - lp_old`` carries the gradient.

    ``grpo``/``dapo``: PPO clip ``max(-r*A, -clip(r, 1-eps_low, 1+eps_high)*A)`` (they differ only in the
    epsilons the config picks); ``dual_clip=c`` caps negative-advantage tokens at ``-c*A``.
    ``cispo`` returns ``-sg(clip(r)) * A * log_ratio``. Since ``log_ratio = lp - lp_old`` and ``lp_old`` is
    constant, this is the spec's ``-sg(clip(r)) * A * lp`` *plus* ``sg(clip(r)) * A * lp_old``: the value is
    offset by that constant, the gradient is exactly the spec's, and clipped tokens keep their gradient
    (torchrl 0.14.1's ``CISPOLoss`` gives them none).
    """
    if kind not in POLICY_KINDS:
        raise ConfigError(f"policy loss kind must be one of {', '.join(POLICY_KINDS)}, got {kind!r}")
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    if kind == "cispo":
        return -clipped.detach() * advantages * log_ratio
    loss = torch.maximum(-ratio * advantages, -clipped * advantages)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    return loss


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate to the reference policy; aliases give identical values."""
    if kind not in KL_KINDS:
        raise ConfigError(f"kl type must be one of {', '.join(KL_KINDS)}, got {kind!r}")
    d = logp - ref_logp
    kind = KL_KINDS[kind]
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    x = (-d).clamp(-20.0, 20.0)
    return (torch.exp(x) - x - 1.0).clamp(-10.0, 10.0)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, *, norm: float | None = None,
              num_tokens: float | None = None, num_seqs: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar; masked positions never count (whatever value they hold).

    For gradient accumulation pass the step's *global* counts, so that summing the micro-batch results
    equals the one-batch value (and the gradient too): ``num_tokens`` (valid tokens over all micro-batches,
    ``token-mean``) and ``num_seqs`` (sequences with at least one valid token, both ``seq-mean-*`` modes:
    they need the global sequence count, a per-micro-batch mean of means would not add up). ``norm`` is the
    constant of ``seq-mean-token-sum-norm`` (default: the token dimension; the learner passes the run's
    generation budget, ``max_new_tokens``, the same for every step), which needs no count at all. Defaults are this
    batch's own counts.
    """
    mode = AGG_ALIASES.get(mode, mode)
    if mode not in AGG_MODES:
        raise ConfigError(f"loss aggregation mode must be one of {', '.join(AGG_MODES)}, got {mode!r}")
    mask = mask.bool()
    m = mask.to(per_token.dtype)
    masked = torch.where(mask, per_token, torch.zeros_like(per_token))  # NaN/inf padding cannot leak
    if mode == "token-mean":
        count = m.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=per_token.dtype)
        return masked.sum() / count.clamp_min(1.0)
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / float(norm if norm is not None else per_token.shape[-1])
    seqs = (m.sum(-1) > 0).to(per_token.dtype)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / m.sum(-1).clamp_min(1.0)
    else:
        per_seq = masked.sum(-1)
    count = seqs.sum() if num_seqs is None else torch.as_tensor(num_seqs, dtype=per_token.dtype)
    return (per_seq * seqs).sum() / count.clamp_min(1.0)


def validate_bounds(name: str, bounds) -> tuple[float, float] | None:
    """``(lower, upper)`` as floats, or a ConfigError that names the option and the expected order."""
    if bounds is None:
        return None
    try:
        lower, upper = (float(b) for b in bounds)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a pair (lower, upper) of numbers, got {bounds!r}") from None
    if not (lower < upper) or lower < 0 or not math.isfinite(upper):
        raise ConfigError(f"{name} must be (lower, upper) with 0 <= lower < upper, got ({lower}, {upper}); "
                          "note the order: lower first (XTuner takes (upper, lower))")
    return lower, upper


def rollout_importance_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *,
                               level: str | None, mode: str = "truncate", lower: float | None = None,
                               upper: float | None = None, veto: tuple[float, float] | None = None,
                               accumulator: MetricsAccumulator | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Rollout-engine vs trainer correction: ``(weights, mask, metrics)``.

    ``log_w = old_logp - rollout_logp`` on valid tokens; ``level`` token / sequence (sum) / geometric (mean);
    ``mode`` truncate (clamp to ``[lower, upper]``), mask (drop tokens or sequences outside, weights left
    unclamped) or both; ``veto=(lo, hi)`` drops a whole sequence with any token ``w`` outside it. The returned
    weights are 0 wherever the returned mask is False. ``level=None`` (or no thresholds) disables the
    correction (weights 1, mask unchanged) but the mismatch and IS metrics are still computed (IS metrics
    describe the raw, unclamped weights). ``accumulator``, if given, also receives the raw sums/extrema so
    that several micro-batches reduce exactly (see :class:`MetricsAccumulator`).
    """
    if level is not None and level not in IS_LEVELS:
        raise ConfigError(f"rollout IS level must be one of {', '.join(IS_LEVELS)}, got {level!r}")
    if mode not in IS_MODES:
        raise ConfigError(f"rollout IS mode must be one of {', '.join(IS_MODES)}, got {mode!r}")
    if (lower is None) != (upper is None):
        raise ConfigError(f"rollout IS thresholds need both lower and upper, got lower={lower}, upper={upper}")
    bounds = validate_bounds("rollout IS thresholds", (lower, upper)) if lower is not None else None
    veto = validate_bounds("rollout IS veto", veto)
    mask = mask.bool()
    m = mask.to(old_logp.dtype)
    log_w = torch.where(mask, old_logp - rollout_logp, torch.zeros_like(old_logp)).detach()
    token_w = torch.exp(log_w.clamp(-20.0, 20.0))
    if level == "sequence":
        raw = torch.exp((log_w * m).sum(-1, keepdim=True).clamp(-20.0, 20.0)).expand_as(log_w)
    elif level == "geometric":
        mean = (log_w * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1.0)
        raw = torch.exp(mean.clamp(-20.0, 20.0)).expand_as(log_w)
    else:
        raw = token_w
    new_mask = mask.clone()
    weights = torch.ones_like(raw)
    vetoed = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    if level is not None and bounds is not None:
        lo, hi = bounds
        weights = raw.clone()
        if mode in ("mask", "both"):
            new_mask &= (raw >= lo) & (raw <= hi)
        if mode in ("truncate", "both"):
            weights = weights.clamp(lo, hi)
    if level is not None and veto is not None:
        veto_lo = math.log(veto[0]) if veto[0] > 0 else -math.inf
        out = mask & ((log_w < veto_lo) | (log_w > math.log(veto[1])))
        vetoed = out.any(-1)
        new_mask &= ~vetoed[:, None]
    weights = torch.where(new_mask, weights, torch.zeros_like(weights))
    acc = MetricsAccumulator()
    valid = mask
    n = valid.sum()
    seq_valid = mask.any(-1)
    acc.mean("mismatch/kl", (-log_w)[valid].sum(), n)
    acc.mean("mismatch/k3_kl", (token_w - log_w - 1.0)[valid].sum(), n)
    acc.mean("mismatch/abs_logp_diff", log_w.abs()[valid].sum(), n)
    seq_len = m.sum(-1).clamp_min(1.0)
    zero = torch.zeros_like(old_logp)
    train_ppl = torch.exp(-torch.where(mask, old_logp, zero).sum(-1) / seq_len)[seq_valid]
    roll_ppl = torch.exp(-torch.where(mask, rollout_logp, zero).sum(-1) / seq_len)[seq_valid]
    acc.mean("mismatch/training_ppl", train_ppl.sum(), seq_valid.sum())
    acc.mean("mismatch/rollout_ppl", roll_ppl.sum(), seq_valid.sum())
    w_valid = raw[valid]
    acc.moments("is/weight", w_valid)
    acc.ess("is/ess", w_valid)
    if bounds is not None:
        acc.mean("is/frac_above_upper", (w_valid > bounds[1]).sum(), n)
        acc.mean("is/frac_below_lower", (w_valid < bounds[0]).sum(), n)
    acc.mean("is/masked_frac", (valid & ~new_mask).sum(), n)
    acc.mean("is/veto_frac", vetoed[seq_valid].sum(), seq_valid.sum())
    if accumulator is not None:
        accumulator.merge(acc)
    return weights.detach(), new_mask, acc.result()


def train_policy_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, *, eps_low: float, eps_high: float,
                         accumulator: MetricsAccumulator) -> None:
    """The spec's train-policy metrics (raw sums/extrema into ``accumulator``)."""
    lr = log_ratio.detach()[mask.bool()].clamp(-20.0, 20.0)
    r = lr.exp()
    n = lr.numel()
    accumulator.mean("train/abs_ratio_minus_1", (r - 1).abs().sum(), n)
    accumulator.mean("train/kl1", (-lr).sum(), n)
    accumulator.mean("train/kl3", (r - 1 - lr).sum(), n)
    accumulator.mean("train/clip_frac_low", (r < 1 - eps_low).sum(), n)
    accumulator.mean("train/clip_frac_high", (r > 1 + eps_high).sum(), n)
    accumulator.extreme("train/ratio_max", r.max() if n else None, "max")
    accumulator.extreme("train/ratio_min", r.min() if n else None, "min")
