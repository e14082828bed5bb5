"""``RbpipeGRPOLoss``: torchrl's ``GRPOLoss`` with rbpipe's objectives, rollout IS, KL types and metrics.

torchrl still recomputes the current log-probs through the actor with its response mask
(``_log_weight``); the objective, aggregation and corrections come from :mod:`rbpipe.loss.functional`.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.objectives.llm import GRPOLoss

from rbpipe.loss.config import LossConfig
from rbpipe.loss.functional import (aggregate, kl_penalty, policy_loss, rollout_importance_weights,
                                    train_policy_metrics)
from rbpipe.loss.metrics import MetricsAccumulator

ROLLOUT_FULL_KEY = ("log_probs", "rollout_full")
REF_KEY = ("next", "ref_log_probs", "full")


def _padded(td: TensorDictBase, key, value=0.0) -> torch.Tensor:
    return td.get(key, as_padded_tensor=True, padding_side="left", padding_value=value)


class RbpipeGRPOLoss(GRPOLoss):
    """GRPO / DAPO / dual-clip / CISPO with rollout importance sampling and KL-to-reference variants.

    ``forward(td, num_tokens=None, num_seqs=None, norm=None)``: the counts are the step's global ones (see
    :func:`rbpipe.loss.aggregate`); raw metric sums of the call are left in ``self.last_metrics``.
    """

    def __init__(self, actor_network, cfg: LossConfig, *, ref_actor=None, old_from_current: bool = False) -> None:
        super().__init__(actor_network, clip_epsilon=(cfg.eps_low, cfg.eps_high), entropy_bonus=cfg.entropy_coef > 0,
                         entropy_coeff=cfg.entropy_coef, masking_strategy="sft")
        self.cfg = cfg
        self.ref_actor = ref_actor
        self.last_metrics = MetricsAccumulator()
        self.old_from_current = old_from_current

    @property
    def needs_old_for_mask(self) -> bool:
        """Whether the policy-loss mask depends on ``lp_old`` (IS masking or veto)."""
        cfg = self.cfg
        return cfg.rollout_is is not None and (cfg.rollout_is_mode in ("mask", "both") or cfg.rollout_is_veto is not None)

    def loss_masks(self, td: TensorDictBase, response_mask: torch.Tensor, lp_old: torch.Tensor | None = None):
        """Rollout-IS weights and the policy-loss mask for a batch (needs no forward pass)."""
        cfg = self.cfg
        if lp_old is None:
            lp_old = _padded(td, self.tensor_keys.sample_log_prob)
        lp_roll = _padded(td, ROLLOUT_FULL_KEY) if ROLLOUT_FULL_KEY in td.keys(True) else lp_old
        lo, hi = cfg.rollout_is_threshold if cfg.rollout_is_threshold else (None, None)
        acc = MetricsAccumulator()
        weights, mask, _ = rollout_importance_weights(lp_old, lp_roll, response_mask, level=cfg.rollout_is,
                                                      mode=cfg.rollout_is_mode, lower=lo, upper=hi,
                                                      veto=cfg.rollout_is_veto, accumulator=acc)
        return weights, mask, acc

    def forward(self, tensordict: TensorDictBase, num_tokens=None, num_seqs=None, norm=None) -> TensorDict:
        cfg = self.cfg
        td = tensordict.copy()
        advantage = _padded(td, self.tensor_keys.advantage)
        log_weight, dist, kl_approx, mask = self._log_weight(td, adv_shape=advantage.shape[:-1])
        lp_old = None
        if self.old_from_current:  # one update per batch: lp_old is lp itself, without gradient
            cur = td.get("_cur_log_prob")
            lp_old = cur.detach()
            log_weight = (cur - lp_old).unsqueeze(-1)
            kl_approx = torch.zeros_like(log_weight)
        log_ratio = log_weight.squeeze(-1)
        adv = advantage.squeeze(-1)
        weights, loss_mask, acc = self.loss_masks(td, mask, lp_old)
        per_token = policy_loss(log_ratio, adv, kind=cfg.loss, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                dual_clip=cfg.dual_clip) * weights
        agg = dict(norm=norm if norm is not None else cfg.agg_norm, num_tokens=num_tokens, num_seqs=num_seqs)
        out = TensorDict({"loss_objective": aggregate(per_token, loss_mask, cfg.loss_agg_mode, **agg)})
        train_policy_metrics(log_ratio, loss_mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high, accumulator=acc)
        with torch.no_grad():  # torchrl's own diagnostics, over the response tokens
            lw = log_ratio[mask]
            clipped = (lw < torch.log1p(-self.clip_epsilon_low)) | (lw > torch.log1p(self.clip_epsilon_high))
            acc.mean("clip_fraction", clipped.sum(), lw.numel())
            acc.mean("kl_approx", kl_approx.squeeze(-1)[mask].sum(), lw.numel())
            acc.ess("ESS", lw.clamp(-20, 20).exp())
        if cfg.entropy_coef > 0:
            entropy = self._get_entropy(dist, adv_shape=advantage.shape[:-1]).squeeze(-1)
            acc.mean("entropy", entropy.detach()[mask].sum(), mask.sum())
            out["loss_entropy"] = -cfg.entropy_coef * aggregate(entropy, mask, cfg.loss_agg_mode, **agg)
        if cfg.kl_coef > 0:
            cur = td.get("_cur_log_prob")
            ref = _padded(td, REF_KEY)
            kl = kl_penalty(cur, ref, cfg.kl_type)
            out["loss_kl_to_ref"] = cfg.kl_coef * aggregate(kl, mask, cfg.loss_agg_mode, **agg)
            acc.mean("kl_to_ref", kl.detach()[mask].sum(), mask.sum())
        self.last_metrics = acc
        return out


def make_loss(actor, cfg: LossConfig, ref_actor=None, *, old_from_current: bool = False) -> RbpipeGRPOLoss:
    if cfg.kl_coef > 0 and ref_actor is None:
        from rbpipe.errors import ConfigError

        raise ConfigError("--kl-coef > 0 needs a reference policy: pass ref_actor (a frozen copy of the initial policy)")
    return RbpipeGRPOLoss(actor, cfg, ref_actor=ref_actor, old_from_current=old_from_current)
