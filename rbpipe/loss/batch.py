"""From stored rows to a loss step: rebuild full sequences, recompute ``lp_old``, accumulate micro-batches."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, lazy_stack

from rbpipe.errors import ConfigError
from rbpipe.loss.logprobs import IGNORE_INDEX, TOKENS_FULL, covers, sft_distribution
from rbpipe.loss.metrics import MetricsAccumulator
from rbpipe.loss.module import REF_KEY, ROLLOUT_FULL_KEY, LossInputError, RbpipeGRPOLoss
from rbpipe.trajectory import ADVANTAGE_KEY, PROMPT_TOKENS_KEY, RESPONSE_TOKENS_KEY, REWARD_KEY, ROLLOUT_LOG_PROBS_KEY

_NEEDED = (PROMPT_TOKENS_KEY, RESPONSE_TOKENS_KEY, ADVANTAGE_KEY)


def _log_probs(actor, rows: list[TensorDict]) -> list[torch.Tensor]:
    """Each row's log-probs over ``tokens.full`` (no grad): the loss's own padded pass where it covers the
    actor (taken tokens only, no full-vocabulary log-softmax), else torchrl's wrapper. Prompt positions are
    zeroed by the caller."""
    td = lazy_stack([r.select("tokens", "masks") for r in rows])
    with torch.no_grad():
        dist = sft_distribution(actor, td) if covers(actor) else None
        if dist is not None:
            action = td.get(TOKENS_FULL, as_padded_tensor=True, padding_side="left", padding_value=IGNORE_INDEX)
            padded = dist.log_prob(action)
            width = padded.shape[1]
            return [padded[i, width - r.get(TOKENS_FULL).numel():] for i, r in enumerate(rows)]
        out = actor(td)
    return [lp.detach() for lp in out.get(("log_probs", "full"), as_list=True)]


def row_tensors(rows: TensorDictBase, key) -> list[torch.Tensor]:
    """Column ``key`` as one flat tensor per row: a lazy stack's own tensors, a stored (nested / dense) column
    unbound once, instead of one row TensorDict per row."""
    if isinstance(rows, LazyStackedTensorDict) and rows.stack_dim == 0:
        return [t.reshape(-1) for t in rows.get(key, as_list=True)]
    column = rows.get(key)
    if _stored_ragged(column):
        return list(column.values().split(column.offsets().diff().tolist()))  # faster than unbind
    return [t.reshape(-1) for t in column.unbind(0)]


def row_sums(rows: TensorDictBase, key) -> torch.Tensor:
    """Each row's sum of column ``key`` (int64): a stored ragged column in one pass, not one sum per row."""
    column = None if isinstance(rows, LazyStackedTensorDict) else rows.get(key)
    if column is not None and _stored_ragged(column):
        return _segment_sums(column.values(), column.offsets().diff())
    tensors = row_tensors(rows, key)
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    # one concatenation and one scatter: a sum and an int() per row cost a visible part of a learner step
    return _segment_sums(torch.cat(tensors), torch.tensor([t.numel() for t in tensors]))


def _segment_sums(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sums (int64) of consecutive segments of ``values`` with the given ``lengths``."""
    row_of = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return torch.zeros(lengths.numel(), dtype=torch.int64).index_add_(0, row_of, values.long())


def _stored_ragged(column) -> bool:
    """A stored ragged 1-D field: a nested tensor ``[rows, j]``."""
    return column.is_nested and column._ragged_idx == 1 and column.dim() == 2


def _new(fields: dict) -> TensorDict:
    # rows built here are consistent by construction: skip the constructor's checks (a large part of a step)
    return TensorDict._new_unsafe(fields, batch_size=torch.Size([]))


def build_loss_batch(rows: TensorDictBase, *, actor, ref_actor=None, recompute_old: bool = True,
                     device: torch.device | str | None = None) -> TensorDictBase:
    """Stored rows (prompt, response, rollout log-probs, advantage) -> the loss input (a lazy stack).

    Per row: ``tokens.full`` (prompt + response), ``tokens.prompt``, ``masks.all_attention_mask``,
    ``advantage`` ``[L, 1]``, ``log_probs.full`` = the learner's own log-prob before the update (``lp_old``,
    no grad, 0 on the prompt), ``log_probs.rollout_full`` = the collector's, aligned the same way, and
    ``next.ref_log_probs.full`` when ``ref_actor`` is given. With one optimizer step per batch ``lp_old``
    equals the current log-prob detached, so ``recompute_old=False`` skips that forward pass (placeholder
    zeros; pair it with ``make_loss(..., old_from_current=True)``). ``device``: where the model runs (the
    rows are read on the CPU); the batch is built there.

    The response is what the row stores, every token of it: a response that stopped at EOS ends with that
    EOS, which is trained on; nothing after it exists, and no mask is ever derived from token values (a pad
    token equal to EOS changes nothing).
    """
    if rows.batch_dims != 1 or rows.shape[0] == 0:
        raise LossInputError("build_loss_batch got no rows: sample at least one group")
    keys = set(rows.keys(True, True))
    missing = [k for k in _NEEDED if k not in keys]
    if missing:
        raise LossInputError(f"a sampled row lacks {', '.join(map(str, missing))}: the learner trains on rows the "
                             "grouping transform wrote (prompt, response, rollout log-probs, advantage)")
    prompts, responses = row_tensors(rows, PROMPT_TOKENS_KEY), row_tensors(rows, RESPONSE_TOKENS_KEY)
    advantages = [a[:1].float() for a in row_tensors(rows, ADVANTAGE_KEY)]
    rollouts = row_tensors(rows, ROLLOUT_LOG_PROBS_KEY) if ROLLOUT_LOG_PROBS_KEY in keys else None
    rewards = [r[:1].float() for r in row_tensors(rows, REWARD_KEY)] if REWARD_KEY in keys else None
    built = []
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        full = torch.cat([prompt, response])
        n_prompt, length = prompt.numel(), full.numel()
        fields: dict[str, Any] = {
            "tokens": _new({"full": full, "prompt": prompt}),
            "masks": _new({"all_attention_mask": torch.ones(length, dtype=torch.bool)}),
            ADVANTAGE_KEY: advantages[i].expand(length, 1).clone()}
        if rollouts is not None:
            rollout = rollouts[i].float()
            if rollout.numel() != response.numel():
                raise LossInputError(f"a row has {response.numel()} response tokens but {rollout.numel()} rollout "
                                     "log-probs: the collector must report one log-prob per response token")
            fields[ROLLOUT_FULL_KEY[0]] = _new({ROLLOUT_FULL_KEY[1]: torch.cat([rollout.new_zeros(n_prompt),
                                                                                rollout])})
        if rewards is not None:
            fields[REWARD_KEY[0]] = _new({REWARD_KEY[1]: rewards[i]})
        built.append(_new(fields))
    if device is not None and torch.device(device) != torch.device("cpu"):
        built = [td.to(device) for td in built]
    prompt_lens = [p.numel() for p in prompts]

    def fill(key, lps):
        for td, lp, p in zip(built, lps, prompt_lens, strict=True):
            lp = lp.clone()
            lp[:p] = 0.0
            td.set(key, lp)

    if recompute_old:
        fill(("log_probs", "full"), _log_probs(actor, built))
    else:
        fill(("log_probs", "full"), [torch.zeros(td.get(TOKENS_FULL).numel(), device=td.device) for td in built])
    if ref_actor is not None:
        fill(REF_KEY, _log_probs(ref_actor, built))
    return lazy_stack(built, 0)


def _response_mask(batch: TensorDictBase) -> torch.Tensor:
    """Left-padded response mask, as torchrl's sft distribution builds it."""
    fulls = batch.get(("tokens", "full"), as_list=True)
    prompts = batch.get(("tokens", "prompt"), as_list=True)
    width = max(f.numel() for f in fulls)
    mask = torch.zeros(len(fulls), width, dtype=torch.bool, device=fulls[0].device)
    for i, (f, p) in enumerate(zip(fulls, prompts, strict=True)):
        mask[i, width - f.numel() + p.numel():] = True
    return mask


#: a micro-batch's activations may take as much memory as the model's weights, and at least this much
MIN_ACTIVATION_BUDGET = 256e6


def auto_micro_batches(model: torch.nn.Module, batch: TensorDictBase, minimum: int = 1) -> int:
    """How many micro-batches keep one micro-batch's activations within ``max(weights, 256 MB)``.

    Why: a step's activations grow with rows x width x layers, not with the model's weights; with a real model they
    are most of the learner's peak memory, and micro-batches give the same gradient at a fraction of the peak
    (figures: docs/DESIGN.md, Figures behind code choices). The estimate per token is float32 ``layers x (10 x hidden +
    4 x intermediate) + 2 x vocab`` values (the decoder's saved activations, the logits and their gradient); the
    demo's tiny model stays at one micro-batch. ``minimum``: ``--micro-batches``."""
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if not (hidden and layers) or batch.shape[0] < 2:
        return minimum
    inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    vocab = getattr(config, "vocab_size", 0) or 0
    per_token = 4 * (layers * (10 * hidden + 4 * inner) + 2 * vocab)
    width = max(t.numel() for t in batch.get(("tokens", "full"), as_list=True))
    budget = max(sum(p.numel() * p.element_size() for p in model.parameters()), MIN_ACTIVATION_BUDGET)
    needed = -(-batch.shape[0] * width * per_token // int(budget))  # ceil
    return int(min(batch.shape[0], max(minimum, needed)))


def step_counts(loss_module: RbpipeGRPOLoss, batch: TensorDictBase) -> dict[str, float]:
    """The step's global aggregation constants: valid tokens and sequences after rollout-IS masking, and the
    ``seq-mean-token-sum-norm`` constant (``agg_norm``, by default the generation budget ``max_new_tokens``;
    only a config with neither falls back to the max response length of the step)."""
    _check_counts_possible(loss_module)
    response = _response_mask(batch)
    _, loss_mask, _ = loss_module.loss_masks(batch, response)
    norm = loss_module.cfg.agg_norm or float(response.sum(-1).max().clamp_min(1))
    return {"num_tokens": float(loss_mask.sum()), "num_seqs": float(loss_mask.any(-1).sum()), "norm": norm}


def _check_counts_possible(loss_module: RbpipeGRPOLoss) -> None:
    if loss_module.old_from_current and loss_module.needs_old_for_mask:
        raise ConfigError("rollout-IS masking/veto needs lp_old before the forward pass: build the batch with "
                          "recompute_old=True and the loss with old_from_current=False")


def train_step(loss_module: RbpipeGRPOLoss, optimizer: torch.optim.Optimizer, batch: TensorDictBase, *,
               micro_batches: int = 1, max_grad_norm: float | None = None,
               autocast: Callable[[], AbstractContextManager] | None = None) -> dict[str, float]:
    """One optimizer step over ``batch`` split into ``micro_batches`` (backward per micro-batch).

    The aggregation uses the step's global counts (:func:`step_counts`) and metrics are reduced from raw
    sums/extrema, so the gradient and every metric equal those of one big batch. Returns floats: each loss
    term, ``loss`` (their sum), the spec's metrics, ``valid_tokens``, ``valid_sequences``, ``grad_norm``
    (when clipping) and ``reward_mean`` (when the rows carry rewards). ``autocast``: a context for each forward
    pass (e.g. bfloat16 over float32 weights, :func:`rbpipe.model.device.autocast`); backward runs outside it.
    """
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ConfigError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    n = batch.shape[0]
    bounds = torch.linspace(0, n, min(micro_batches, n) + 1).round().long().tolist()
    if len(bounds) > 2:
        counts = step_counts(loss_module, batch)
    else:  # one micro-batch is the whole step: its own counts are the global ones (a second pass would only cost time)
        _check_counts_possible(loss_module)
        counts = {}
    optimizer.zero_grad(set_to_none=True)
    acc = MetricsAccumulator()
    totals: dict[str, float] = {}
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        with autocast() if autocast is not None else contextlib.nullcontext():
            out = loss_module(batch[a:b], **counts)
        terms = [k for k in out.keys() if k.startswith("loss_")]
        sum(out.get(k) for k in terms).backward()
        for k in terms:
            totals[k] = totals.get(k, 0.0) + float(out.get(k).detach())
        acc.merge(loss_module.last_metrics)
    counts = counts or loss_module.last_counts
    metrics = {**acc.result(), **totals, "loss": sum(totals.values()),
               "valid_tokens": counts["num_tokens"], "valid_sequences": counts["num_seqs"]}
    if max_grad_norm is not None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    optimizer.step()
    if REWARD_KEY in batch.keys(True, True):
        metrics["reward_mean"] = float(batch.get(REWARD_KEY).float().mean())
    return metrics
