"""torchrl ``GRPOLoss`` subclasses with rbpipe's objectives, rollout IS, KL types and metrics.

torchrl's ``_log_weight`` still drives the current log-probs (``_get_cur_log_prob``: here from one padded
forward pass, :mod:`rbpipe.loss.logprobs`, equal to ``actor._get_sft_dist``'s); the objective, aggregation,
corrections and metrics come from :mod:`rbpipe.loss.functional`. One loss mask serves every term: tokens
dropped by rollout-IS masking or veto leave the policy loss, the KL and entropy terms and the valid-token
count alike; the IS weights multiply the policy loss only.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.objectives.llm import DAPO, CISPOLoss, GRPOLoss

from rbpipe.errors import ConfigError, RbpipeError
from rbpipe.loss.config import LossConfig
from rbpipe.loss.functional import aggregate, kl_penalty, policy_loss, rollout_importance_weights, train_policy_metrics
from rbpipe.loss.logprobs import ResponseLogits, covers, sft_distribution
from rbpipe.loss.metrics import MetricsAccumulator

ROLLOUT_FULL_KEY = ("log_probs", "rollout_full")
REF_KEY = ("next", "ref_log_probs", "full")
#: where torchrl's GRPOLoss._log_weight leaves the current log-probs (in the loss input)
CUR_LOG_PROB = "_cur_log_prob"


class LossInputError(RbpipeError, ValueError):
    """The batch handed to the loss lacks a field the configuration needs, or has the wrong shape."""


def _padded(td: TensorDictBase, key, value=0.0) -> torch.Tensor:
    """Left-padded like torchrl's log-probs (torchrl 0.14.1 pads ``advantage`` on the right: a misalignment
    for ragged rows that this module avoids by padding every per-token field on the left)."""
    return td.get(key, as_padded_tensor=True, padding_side="left", padding_value=value)


def _has(td: TensorDictBase, key) -> bool:
    return key in td.keys(include_nested=True)


class RbpipeGRPOLoss(GRPOLoss):
    """GRPO (PPO clip, optional dual-clip) with rollout importance sampling, KL-to-reference types and the
    spec's metrics. :class:`RbpipeDAPOLoss` and :class:`RbpipeCISPOLoss` are the other objectives; pick one
    with :func:`make_loss`.

    ``forward(td, *, num_tokens=None, num_seqs=None, norm=None)`` returns a ``TensorDict`` with the loss
    terms (``loss_objective``, ``loss_entropy`` if ``entropy_coef > 0``, ``loss_kl_to_ref`` if
    ``kl_coef > 0``) and this call's metrics as detached scalars (torchrl's ``ESS``, ``clip_fraction``,
    ``kl_approx``, ``entropy``, plus ``mismatch/*``, ``is/*``, ``train/*``). The counts are the step's global
    ones (see :func:`rbpipe.loss.aggregate`); the call's raw metric sums are kept in ``self.last_metrics``
    so micro-batches reduce exactly (:func:`rbpipe.loss.train_step` does both).

    ``old_from_current=True`` uses ``lp.detach()`` as ``lp_old`` (valid with one optimizer step per batch,
    saves the recompute forward pass); it cannot be combined with IS masking/veto in ``train_step``.
    """

    kind = "grpo"

    def __init__(self, actor_network, cfg: LossConfig | None = None, *, ref_actor=None,
                 old_from_current: bool = False) -> None:
        cfg = LossConfig(loss=self.kind) if cfg is None else cfg
        if cfg.loss != self.kind:
            raise ConfigError(f"{type(self).__name__} computes the {self.kind!r} objective but the config asks "
                              f"for {cfg.loss!r}: build the loss with rbpipe.loss.make_loss(actor, cfg)")
        super().__init__(actor_network, clip_epsilon=(cfg.eps_low, cfg.eps_high),
                         entropy_bonus=cfg.entropy_coef > 0, entropy_coeff=cfg.entropy_coef,
                         kl_to_ref_coeff=cfg.kl_coef or None, masking_strategy="sft")
        self.cfg = cfg
        # not a submodule: its frozen weights stay out of .parameters()
        object.__setattr__(self, "ref_actor", ref_actor)
        self.old_from_current = old_from_current
        self.last_metrics = MetricsAccumulator()

    # -- torchrl hook: the current log-probs from one padded forward pass (rbpipe.loss.logprobs) --
    def _get_cur_log_prob(self, tensordict: TensorDictBase):
        dist = None
        if self.masking_strategy == "sft" and covers(self.actor_network):
            dist = sft_distribution(self.actor_network, tensordict)
        if dist is None:
            return super()._get_cur_log_prob(tensordict)
        action = tensordict.get(self.tensor_keys.action, as_padded_tensor=True, padding_side="left",
                                padding_value=-100)
        return dist.log_prob(action), dist, False

    # -- torchrl hook: anyone driving the parent's pipeline gets our objective (CISPO with stop-gradient) --
    def _compute_policy_objective(self, log_weight: torch.Tensor, advantage: torch.Tensor):
        cfg = self.cfg
        eps_low, eps_high = cfg.clip_eps
        loss = policy_loss(log_weight, advantage, kind=cfg.loss, eps_low=eps_low, eps_high=eps_high,
                           dual_clip=cfg.dual_clip)
        with torch.no_grad():
            lo, hi = self._clip_bounds
            clip_fraction = ((log_weight < lo) | (log_weight > hi)).to(log_weight.dtype).mean()
        return loss, clip_fraction

    def _entropy(self, dist, adv: torch.Tensor) -> torch.Tensor:
        """Per-token entropy ``[rows, width]``: row by row for the padded pass (:class:`ResponseLogits`),
        torchrl's ``_get_entropy`` for its own distributions."""
        if isinstance(dist, ResponseLogits):
            return dist.entropy()
        return self._get_entropy(dist, adv_shape=adv.shape).squeeze(-1)

    @property
    def needs_old_for_mask(self) -> bool:
        """Whether the loss mask depends on ``lp_old`` (IS masking or veto): then ``lp_old`` must be in the batch
        before the step, to count the step's valid tokens."""
        cfg = self.cfg
        return cfg.rollout_is is not None and (cfg.rollout_is_mode in ("mask", "both")
                                               or cfg.rollout_is_veto is not None)

    def loss_masks(self, td: TensorDictBase, response_mask: torch.Tensor, lp_old: torch.Tensor | None = None):
        """``(weights, loss_mask, accumulator)``: rollout-IS weights and the loss mask (no forward pass)."""
        cfg = self.cfg
        if lp_old is None:
            lp_old = _padded(td, self.tensor_keys.sample_log_prob)
        lp_roll = _padded(td, ROLLOUT_FULL_KEY) if _has(td, ROLLOUT_FULL_KEY) else lp_old
        if lp_roll.shape != response_mask.shape:
            raise LossInputError(f"{'.'.join(ROLLOUT_FULL_KEY)} has shape {tuple(lp_roll.shape)} but the tokens "
                                 f"give {tuple(response_mask.shape)}: store one rollout log-prob per token of "
                                 "tokens.full (0 on the prompt); rbpipe.loss.build_loss_batch does this")
        lo, hi = cfg.rollout_is_threshold if cfg.rollout_is_threshold else (None, None)
        acc = MetricsAccumulator()
        weights, mask, _ = rollout_importance_weights(lp_old, lp_roll, response_mask, level=cfg.rollout_is,
                                                      mode=cfg.rollout_is_mode, lower=lo, upper=hi,
                                                      veto=cfg.rollout_is_veto, accumulator=acc)
        return weights, mask, acc

    def _advantage(self, td: TensorDictBase) -> torch.Tensor:
        if not _has(td, self.tensor_keys.advantage):
            raise LossInputError(f"the batch has no {self.tensor_keys.advantage!r}: the grouping transform "
                                 "(MCAdvantage) writes it; build the batch with rbpipe.loss.build_loss_batch")
        return _padded(td, self.tensor_keys.advantage)

    @staticmethod
    def _per_token(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if adv.ndim == mask.ndim + 1 and adv.shape[-1] == 1:
            adv = adv.squeeze(-1)
        if adv.shape != mask.shape:
            raise LossInputError(f"advantage has shape {tuple(adv.shape)} but the tokens give {tuple(mask.shape)}: "
                                 "broadcast each row's advantage to [len(tokens.full), 1]")
        return adv

    def forward(self, tensordict: TensorDictBase, *, num_tokens=None, num_seqs=None, norm=None) -> TensorDict:
        # torchrl's _log_weight writes CUR_LOG_PROB into its input. It is removed again afterwards instead of
        # running on a copy: a lazy stack's copy copies every row (figures: docs/DESIGN.md, Figures behind code
        # choices). A locked input, or one that already holds the key, still gets a copy.
        if tensordict.is_locked or CUR_LOG_PROB in tensordict.keys():
            return self._forward(tensordict.copy(), num_tokens, num_seqs, norm)
        try:
            return self._forward(tensordict, num_tokens, num_seqs, norm)
        finally:
            if CUR_LOG_PROB in tensordict.keys():
                tensordict.del_(CUR_LOG_PROB)

    def _forward(self, td: TensorDictBase, num_tokens, num_seqs, norm) -> TensorDict:
        cfg = self.cfg
        adv = self._advantage(td)
        log_weight, dist, _, mask = self._log_weight(td, adv_shape=adv.shape[:-1])
        adv = self._per_token(adv, mask)
        cur = td.get(CUR_LOG_PROB)
        if self.old_from_current:  # one update per batch: lp_old is lp itself, without gradient
            lp_old = cur.detach()
            log_ratio = cur - lp_old
        else:
            log_ratio = log_weight.squeeze(-1)
            lp_old = (cur - log_ratio).detach()  # torchrl's masked lp_old, without padding it again
        weights, loss_mask, acc = self.loss_masks(td, mask, lp_old)
        if norm is None:
            norm = cfg.agg_norm if cfg.agg_norm is not None else float(mask.sum(-1).max().clamp_min(1))
        agg = dict(norm=norm, num_tokens=num_tokens, num_seqs=num_seqs)
        eps_low, eps_high = cfg.clip_eps
        per_token = policy_loss(log_ratio, adv, kind=cfg.loss, eps_low=eps_low, eps_high=eps_high,
                                dual_clip=cfg.dual_clip) * weights
        out = {"loss_objective": aggregate(per_token, loss_mask, cfg.loss_agg_mode, **agg)}
        train_policy_metrics(log_ratio, loss_mask, eps_low=eps_low, eps_high=eps_high, accumulator=acc)
        n_valid = loss_mask.sum()
        with torch.no_grad():  # torchrl's own diagnostics, over the valid tokens
            lw = log_ratio.detach()[loss_mask]
            lo, hi = self._clip_bounds
            acc.mean("clip_fraction", ((lw < lo) | (lw > hi)).sum(), n_valid)
            acc.mean("kl_approx", (-lw).sum(), n_valid)
            acc.ess("ESS", lw.clamp(-20, 20).exp())
        if cfg.entropy_coef > 0:
            entropy = self._entropy(dist, adv)
            out["loss_entropy"] = -cfg.entropy_coef * aggregate(entropy, loss_mask, cfg.loss_agg_mode, **agg)
        else:  # a metric only: nothing of it is kept for backward
            with torch.no_grad():
                entropy = self._entropy(dist, adv)
        acc.mean("entropy", torch.where(loss_mask, entropy.detach(), 0.0).sum(), n_valid)
        if cfg.kl_coef > 0 and not _has(td, REF_KEY):
            raise LossInputError(f"kl_coef={cfg.kl_coef} needs reference log-probs at {'.'.join(REF_KEY)}: build "
                                 "the batch with rbpipe.loss.build_loss_batch(rows, actor=..., ref_actor=...)")
        if _has(td, REF_KEY):
            ref = _padded(td, REF_KEY)
            if ref.shape != cur.shape:
                raise LossInputError(f"{'.'.join(REF_KEY)} has shape {tuple(ref.shape)}, expected "
                                     f"{tuple(cur.shape)} (one log-prob per token of tokens.full)")
            kl = kl_penalty(cur, ref, cfg.kl_type)
            if cfg.kl_coef > 0:
                out["loss_kl_to_ref"] = cfg.kl_coef * aggregate(kl, loss_mask, cfg.loss_agg_mode, **agg)
            acc.mean("kl_to_ref", torch.where(loss_mask, kl.detach(), 0.0).sum(), n_valid)
        self.last_metrics = acc
        self.last_counts = {"num_tokens": float(n_valid), "num_seqs": float(loss_mask.any(-1).sum())}
        out.update({k: torch.tensor(v) for k, v in acc.result().items()})
        return TensorDict(out)


class RbpipeDAPOLoss(RbpipeGRPOLoss, DAPO):
    """DAPO clip-higher: the GRPO objective with ``(eps_low, eps_high)`` defaulting to ``(0.20, 0.28)``."""

    kind = "dapo"


class RbpipeCISPOLoss(RbpipeGRPOLoss, CISPOLoss):
    """CISPO ``-sg(clip(r)) * A * lp``: clipped tokens keep their gradient (torchrl 0.14.1's gives them none)."""

    kind = "cispo"


LOSS_CLASSES = {cls.kind: cls for cls in (RbpipeGRPOLoss, RbpipeDAPOLoss, RbpipeCISPOLoss)}


def make_loss(actor, cfg: LossConfig, ref_actor=None, *, old_from_current: bool = False) -> RbpipeGRPOLoss:
    """The loss module ``cfg.loss`` names. ``ref_actor`` (a frozen copy of the initial policy) is required
    when ``cfg.kl_coef > 0``; it is used by :func:`rbpipe.loss.build_loss_batch` to fill the ref log-probs."""
    if cfg.kl_coef > 0 and ref_actor is None:
        raise ConfigError(f"kl_coef={cfg.kl_coef} needs a reference policy: pass ref_actor (a frozen copy of the "
                          "initial policy, e.g. build_learner_actor(copy.deepcopy(model).requires_grad_(False)))")
    return LOSS_CLASSES[cfg.loss](actor, cfg, ref_actor=ref_actor, old_from_current=old_from_current)


def one_update_loss(actor, cfg: LossConfig, ref_actor=None) -> RbpipeGRPOLoss:
    """:func:`make_loss` for a learner that takes one optimizer step per batch (rbpipe's learner, the benchmark's
    one-process loop): ``lp_old`` is ``lp.detach()``, identical to a recomputed one and a forward pass cheaper,
    except where the loss mask needs ``lp_old`` before the step (rollout-IS masking or veto). Build its batches
    with ``build_loss_batch(..., recompute_old=not loss.old_from_current)``."""
    loss = make_loss(actor, cfg, ref_actor=ref_actor)
    loss.old_from_current = not loss.needs_old_for_mask
    return loss
