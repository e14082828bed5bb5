"""The current policy's response distribution for the loss, from one padded forward pass, at the memory of
the model rather than of its vocabulary.

torchrl's ``GRPOLoss`` gets it from the actor (``TransformersWrapper._get_sft_dist``), which runs the same
left-padded forward pass and then unpads logits, masks and tokens into per-row lazy stacks only to pad them
again: on the demo learner that TensorDict round trip cost more than the model itself (figures: docs/DESIGN.md, Figures
behind code choices). :func:`sft_distribution` keeps the padded tensors; the values and gradients are the wrapper's
(``tests/loss/test_logprobs.py``). Actors it does not cover fall back to torchrl's path.

Why not ``LLMMaskedCategorical``: with a real vocabulary (SmolLM2's 49,152 tokens) every full-vocabulary
tensor of a step is ``rows x width x vocab`` floats (hundreds of MB for a demo-sized step in float32). Shifting the
logits, masking them, a float32 log-softmax, and an entropy computed with gradients kept (even at ``entropy_coef=0``)
held eight of them at once. :class:`ResponseLogits` keeps only the logits of the positions that predict a
response token (``logits_to_keep``), takes the chosen tokens' log-probs as ``logit - logsumexp`` one row at a
time (TRL's ``selective_log_softmax``), and computes the entropy row by row, without gradient unless the loss
uses it (then each row is recomputed in backward rather than kept).
"""

from __future__ import annotations

import functools
import inspect

import torch
from tensordict import TensorDictBase
from torch.utils.checkpoint import checkpoint
from torchrl.modules.llm import TransformersWrapper

TOKENS_FULL = ("tokens", "full")
TOKENS_PROMPT = ("tokens", "prompt")
ATTENTION_MASK = ("masks", "all_attention_mask")
#: what torchrl's distributions take as "no token here" in an action tensor
IGNORE_INDEX = -100


def covers(actor) -> bool:
    """Whether :func:`sft_distribution` computes what ``actor._get_sft_dist`` would: a Hugging Face model in
    torchrl's ``TransformersWrapper``, log-prob mode, token input, padded model input."""
    return (isinstance(actor, TransformersWrapper) and actor.input_mode == "tokens" and not actor.generate
            and bool(actor.pad_model_input) and actor.input_key == TOKENS_FULL)


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits, -1).gather(-1, index)`` without a full-vocabulary log-softmax tensor.

    One row at a time: ``logit[index] - logsumexp(logits)`` in float32 and float64; low-precision logits
    (bfloat16 under autocast) are upcast to float32 row by row, so the ratios the loss takes are float32.
    """
    if logits.dtype in (torch.float32, torch.float64):
        taken = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        return taken - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    return torch.stack([torch.log_softmax(row.float(), dim=-1).gather(-1, i.unsqueeze(-1)).squeeze(-1)
                        for row, i in zip(logits, index, strict=True)])


def _row_entropy(row: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(row.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_entropy(logits: torch.Tensor, *, grad: bool) -> torch.Tensor:
    """Entropy of each position's distribution (float32), one row at a time. Without ``grad`` nothing is kept;
    with it, each row is recomputed in backward (activation checkpointing) instead of keeping its softmax."""
    if not grad:
        with torch.no_grad():
            return torch.stack([_row_entropy(row) for row in logits])
    return torch.stack([checkpoint(_row_entropy, row, use_reentrant=False) for row in logits])


class ResponseLogits:
    """The response tokens' next-token distributions, as the loss reads them: ``mask``, ``log_prob(action)``
    and ``entropy()`` over the left-padded ``[rows, width]`` grid (0 off the mask).

    ``logits[:, j]`` predicts the token at column ``width - span + j``: the last ``span`` columns hold every
    row's response (rows are left-padded, responses end at the right).
    """

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.logits, self.mask = logits, mask
        self.span = logits.shape[1]

    def _widen(self, values: torch.Tensor) -> torch.Tensor:
        """``[rows, span]`` -> ``[rows, width]``, zero off the mask."""
        rows, width = self.mask.shape
        full = torch.cat([values.new_zeros(rows, width - self.span), values], 1)
        return torch.where(self.mask, full, torch.zeros_like(full))

    def log_prob(self, action: torch.Tensor) -> torch.Tensor:
        """Log-prob (float32) of each response token of ``action`` (``[rows, width]``, left-padded)."""
        mask = self.mask[:, -self.span:]
        taken = torch.where(mask, action[:, -self.span:], 0)
        return self._widen(selective_log_softmax(self.logits, taken))

    def entropy(self) -> torch.Tensor:
        """Float32 entropies; kept for backward only when gradients are on (the loss's metric runs without)."""
        return self._widen(token_entropy(self.logits, grad=torch.is_grad_enabled()))


@functools.cache
def _keeps_logits(model_cls: type[torch.nn.Module]) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (transformers >= 4.50's causal LMs do)."""
    return "logits_to_keep" in inspect.signature(model_cls.forward).parameters


def sft_distribution(actor, td: TensorDictBase) -> ResponseLogits | None:
    """Next-token distributions over ``tokens.full`` (left-padded), masked to each row's response tokens.

    The mask is the attention mask without each row's prompt: it never looks at token values, so a pad token
    equal to EOS (SmolLM2's) cannot hide a response's final EOS. The model is called with keyword arguments
    (GPT-2's second positional parameter is not the mask) and, where it can, with ``logits_to_keep`` set to
    the response span. ``None`` when a row's attention mask has gaps (the wrapper drops those positions: use
    its path); rbpipe's rows have none."""
    tokens = td.get(TOKENS_FULL, as_padded_tensor=True, padding_side="left", padding_value=0)
    attention = td.get(ATTENTION_MASK, as_padded_tensor=True, padding_side="left", padding_value=False).bool()
    if not (attention[:, 1:] >= attention[:, :-1]).all():  # not one run of True per row, ending at the right
        return None
    device = tokens.device
    prompt_lengths = torch.tensor([p.numel() for p in td.get(TOKENS_PROMPT, as_list=True)], device=device)
    width = attention.shape[1]
    first = width - attention.sum(1)  # where each row's tokens start (left padding)
    position = torch.arange(width, device=device)
    response = attention & (position >= (first + prompt_lengths).unsqueeze(1))
    # the logits at columns [width - span - 1, width - 2] predict every response token
    span = max(1, min(width - 1, int(response.sum(1).max())))
    model = actor.model
    # (torch's stub of Module.__hash__ makes mypy take the class object for unhashable)
    keep = {"logits_to_keep": span + 1} if _keeps_logits(type(model)) else {}  # type: ignore[arg-type]
    logits = model(input_ids=tokens, attention_mask=attention, **keep)["logits"]
    return ResponseLogits(logits[:, -span - 1:-1], response)
