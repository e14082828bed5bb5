"""Batched, KV-cached sampling whose rows stop independently at a stop token or stop string.

Why rbpipe samples with its own loop rather than ``model.generate``: a rollout must report the log-prob of each
sampled token under the distribution it was *actually* drawn from (temperature, top-k, top-p applied), which
rollout importance sampling compares with the learner's, and ``generate`` returns the raw logits' scores. The loop
is the one ``generate`` runs (one forward over the prompts, then one cached forward per token for every row), so
it costs the same (``bench/generation.py`` measures both).

A row is finished when it samples a stop token (the tokenizer's / generation config's EOS ids) or its decoded text
gains a stop string; its response ends with that token (included) and nothing sampled after it is kept. The batch
ends when every row has finished or ``max_new_tokens`` were sampled (``finish_reason`` ``"length"``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

STOP = "stop"
LENGTH = "length"


@dataclass(frozen=True)
class Sampling:
    """How responses are sampled; ``max_new_tokens`` is only the cap when stop ids or strings are given.

    Examples:
        >>> Sampling(max_new_tokens=16, temperature=0.7, top_p=0.9, stop_ids=(2,)).top_p
        0.9
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Response:
    """One sampled response: ``tokens`` and the ``log_probs`` they were sampled with (1-D, equal lengths),
    ``finish_reason`` :data:`STOP` (ends with its stop token or string) or :data:`LENGTH` (cut at the cap)."""

    tokens: torch.Tensor
    log_probs: torch.Tensor
    finish_reason: str


def stop_token_ids(tokenizer: Any = None, model: Any = None) -> tuple[int, ...]:
    """The EOS ids a response stops at: the tokenizer's and the model's generation config's (chat models often
    list several, e.g. ``<|im_end|>`` and ``<|endoftext|>``), in that order, without repeats."""
    found: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v >= 0 and v not in found:
                found.append(v)

    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        if config is not None:
            add(getattr(config, "eos_token_id", None))
    return tuple(found)


@functools.cache
def _cache_arg(model_cls: type[torch.nn.Module]) -> str:
    """transformers >= 5 names the KV cache argument ``cache`` (``past_key_values`` warns); older: the latter."""
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def _filter(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Logits with the tokens outside top-k / the top-p nucleus at -inf (at least one token always kept)."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        outside = probs.cumsum(-1) - probs > top_p  # the mass before a token already covers top_p
        logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return logits


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: Sequence[torch.Tensor], counts: Sequence[int], sampling: Sampling, *,
             pad_id: int = 0, tokenizer: Any = None,
             generator: torch.Generator | None = None) -> list[list[Response]]:
    """``counts[i]`` responses to ``prompts[i]`` in one batch: one list of :class:`Response` per prompt.

    Prompts of different lengths are left-padded with ``pad_id`` and masked, with positions counted from each
    prompt's first token, so every row sees exactly what it would see alone. ``tokenizer`` is needed only for
    ``sampling.stop_strings`` (each unfinished row's newest tokens are decoded after every step)."""
    if sampling.stop_strings and tokenizer is None:
        raise ValueError("stop strings need the tokenizer that decodes the responses")
    lengths = [int(p.numel()) for p in prompts]
    width, rows = max(lengths), sum(counts)
    device = next(model.parameters()).device  # --collector-device: the batch lives where the model does
    ids = torch.full((rows, width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((rows, width), dtype=torch.long, device=device)
    row = 0
    for prompt, n, size in zip(prompts, counts, lengths, strict=True):
        ids[row:row + n, width - size:] = prompt.reshape(1, -1)
        mask[row:row + n, width - size:] = 1
        row += n
    padded = min(lengths) != width
    extra = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)} if padded else {}
    # (torch's stub of Module.__hash__ makes mypy take the class object for unhashable)
    cache_arg = _cache_arg(type(model))  # type: ignore[arg-type]
    use_cache = sampling.max_new_tokens > 1
    stop_ids = torch.tensor(sampling.stop_ids, dtype=torch.long, device=device) if sampling.stop_ids else None
    tail = max((len(s) for s in sampling.stop_strings), default=0) + 8  # tokens decoded per stop-string check
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    length = torch.zeros(rows, dtype=torch.long, device=device)
    tokens: list[torch.Tensor] = []
    log_probs: list[torch.Tensor] = []
    past, step_input = None, ids
    for _ in range(sampling.max_new_tokens):
        out = model(input_ids=step_input, use_cache=use_cache, **({cache_arg: past} if use_cache else {}), **extra)
        past = getattr(out, cache_arg) if use_cache else None
        logits = _filter(out.logits[:, -1, :].float() / sampling.temperature, sampling.top_k, sampling.top_p)
        logp = torch.log_softmax(logits, dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=generator)
        tokens.append(nxt)
        log_probs.append(logp.gather(-1, nxt))
        length += ~done
        if stop_ids is not None:
            done |= torch.isin(nxt[:, 0], stop_ids)
        if sampling.stop_strings:
            _stop_strings(done, torch.cat(tokens, -1), length, tokenizer, sampling.stop_strings, tail)
        if stop_ids is not None or sampling.stop_strings:
            if bool(done.all()):
                break
        step_input = nxt
        if padded:
            mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype, device=device)], dim=1)
            extra = {"attention_mask": mask, "position_ids": extra["position_ids"][:, -1:] + 1}
    all_tokens, all_lps = torch.cat(tokens, -1).cpu(), torch.cat(log_probs, -1).cpu()  # stored from the CPU
    done, length = done.cpu(), length.cpu()
    out_rows = [Response(all_tokens[r, :int(length[r])], all_lps[r, :int(length[r])],
                         STOP if bool(done[r]) else LENGTH) for r in range(rows)]
    grouped, start = [], 0
    for n in counts:
        grouped.append(out_rows[start:start + n])
        start += n
    return grouped


def _stop_strings(done: torch.Tensor, tokens: torch.Tensor, length: torch.Tensor, tokenizer: Any,
                  stop_strings: Iterable[str], tail: int) -> None:
    """Mark the unfinished rows whose newest tokens decode to text containing a stop string (checked after every
    token, so a string found in the tail is one that the newest token completed)."""
    for r in (~done).nonzero().flatten().tolist():
        n = int(length[r])
        text = tokenizer.decode(tokens[r, max(0, n - tail):n].tolist(), skip_special_tokens=True)
        if any(s in text for s in stop_strings):
            done[r] = True
