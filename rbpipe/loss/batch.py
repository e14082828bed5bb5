"""From stored rows to a loss step: rebuild full sequences, recompute ``lp_old``, accumulate micro-batches."""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack

from rbpipe.loss.metrics import MetricsAccumulator
from rbpipe.loss.module import REF_KEY, ROLLOUT_FULL_KEY, RbpipeGRPOLoss
from rbpipe.schema import ADVANTAGE_KEY, PROMPT_TOKENS_KEY, RESPONSE_TOKENS_KEY, REWARD_KEY, ROLLOUT_LOG_PROBS_KEY


def _log_probs(actor, rows: list[TensorDict]) -> list[torch.Tensor]:
    with torch.no_grad():
        out = actor(lazy_stack([r.select("tokens", "masks") for r in rows]))
    return [lp.detach() for lp in out.get(("log_probs", "full"), as_list=True)]


def build_loss_batch(rows: TensorDictBase, *, actor, ref_actor=None, recompute_old: bool = True) -> TensorDictBase:
    """Stored rows (prompt, response, rollout log-probs, advantage) -> ``RbpipeGRPOLoss`` input.

    ``log_probs.full`` is the learner's own log-prob before the update (``lp_old``, no grad), 0 on the
    prompt; ``log_probs.rollout_full`` the collector's, aligned the same way. With one optimizer step per
    batch, ``lp_old`` equals the current log-prob detached, so ``recompute_old=False`` skips this extra
    forward pass and the loss uses ``lp.detach()`` (same values, one forward instead of two).
    """
    built = []
    for row in rows.unbind(0):
        prompt, response = row.get(PROMPT_TOKENS_KEY).reshape(-1), row.get(RESPONSE_TOKENS_KEY).reshape(-1)
        full = torch.cat([prompt, response])
        n_prompt, length = prompt.numel(), full.numel()
        td = TensorDict({"tokens": TensorDict(full=full, prompt=prompt),
                         "masks": TensorDict(all_attention_mask=torch.ones(length, dtype=torch.bool)),
                         "log_probs": TensorDict(rollout_full=torch.cat([torch.zeros(n_prompt),
                                                                          row.get(ROLLOUT_LOG_PROBS_KEY).reshape(-1).float()])),
                         ADVANTAGE_KEY: row.get(ADVANTAGE_KEY).reshape(-1)[:1].float().expand(length, 1).clone(),
                         REWARD_KEY: row.get(REWARD_KEY).reshape(-1)[:1].float()}, batch_size=[])
        built.append(td)
    prompt_lens = [r.get(("tokens", "prompt")).numel() for r in built]
    olds = _log_probs(actor, built) if recompute_old else [None] * len(built)
    for td, lp, p in zip(built, olds, prompt_lens):
        if lp is None:  # placeholder; RbpipeGRPOLoss(old_from_current=True) uses lp.detach()
            lp = torch.zeros(td.get(("tokens", "full")).numel())
        lp = lp.clone()
        lp[:p] = 0.0
        td.set(("log_probs", "full"), lp)
    if ref_actor is not None:
        for td, lp, p in zip(built, _log_probs(ref_actor, built), prompt_lens):
            lp = lp.clone()
            lp[:p] = 0.0
            td.set(REF_KEY, lp)
    return lazy_stack(built, 0)


def _response_mask(batch: TensorDictBase) -> torch.Tensor:
    """Left-padded response mask, as torchrl's sft distribution builds it."""
    fulls = batch.get(("tokens", "full"), as_list=True)
    prompts = batch.get(("tokens", "prompt"), as_list=True)
    width = max(f.numel() for f in fulls)
    mask = torch.zeros(len(fulls), width, dtype=torch.bool)
    for i, (f, p) in enumerate(zip(fulls, prompts)):
        mask[i, width - f.numel() + p.numel():] = True
    return mask


def train_step(loss_module: RbpipeGRPOLoss, optimizer: torch.optim.Optimizer, batch: TensorDictBase, *,
               micro_batches: int = 1, max_grad_norm: float | None = None) -> dict[str, float]:
    """One optimizer step over ``batch`` split in ``micro_batches``; equals one big batch (global counts)."""
    if loss_module.old_from_current and loss_module.needs_old_for_mask:
        raise ValueError("rollout-IS masking/veto needs lp_old before the forward pass: build the batch with "
                         "recompute_old=True")
    _, loss_mask, _ = loss_module.loss_masks(batch, _response_mask(batch))
    num_tokens = float(loss_mask.sum())
    num_seqs = float(loss_mask.any(-1).sum())
    norm = loss_module.cfg.agg_norm or float(max(r.numel() for r in batch.get(("tokens", "full"), as_list=True))
                                             - min(p.numel() for p in batch.get(("tokens", "prompt"), as_list=True)))
    optimizer.zero_grad(set_to_none=True)
    acc = MetricsAccumulator()
    totals: dict[str, float] = {}
    n = batch.shape[0]
    bounds = torch.linspace(0, n, micro_batches + 1).round().long().tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b <= a:
            continue
        out = loss_module(batch[a:b], num_tokens=num_tokens, num_seqs=num_seqs, norm=norm)
        loss = sum(out.get(k) for k in out.keys() if k.startswith("loss_"))
        loss.backward()
        for k in out.keys():
            totals[k] = totals.get(k, 0.0) + float(out.get(k).detach())
        acc.merge(loss_module.last_metrics)
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(loss_module.actor_network.parameters(), max_grad_norm))
    optimizer.step()
    metrics = {**totals, "loss": sum(totals.values()), **acc.result(), "valid_tokens": num_tokens}
    if grad_norm is not None:
        metrics["grad_norm"] = grad_norm
    rewards = batch.get(REWARD_KEY)
    metrics["reward_mean"] = float(rewards.float().mean())
    return metrics
