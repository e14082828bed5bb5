"""The current policy's response distribution for the loss, from one padded forward pass.

torchrl's ``GRPOLoss`` gets it from the actor (``TransformersWrapper._get_sft_dist``), which runs the same
left-padded forward pass and then unpads logits, masks and tokens into per-row lazy stacks only to pad them
again: on the demo learner that TensorDict round trip was ~30% of a train step, more than the model itself.
:func:`sft_distribution` keeps the padded tensors; the values and gradients are the wrapper's
(``tests/loss/test_logprobs.py``). Actors it does not cover fall back to torchrl's path.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torchrl.modules.distributions import LLMMaskedCategorical
from torchrl.modules.llm import TransformersWrapper

TOKENS_FULL = ("tokens", "full")
TOKENS_PROMPT = ("tokens", "prompt")
ATTENTION_MASK = ("masks", "all_attention_mask")


def covers(actor) -> bool:
    """Whether :func:`sft_distribution` computes what ``actor._get_sft_dist`` would: a Hugging Face model in
    torchrl's ``TransformersWrapper``, log-prob mode, token input, padded model input."""
    return (isinstance(actor, TransformersWrapper) and actor.input_mode == "tokens" and not actor.generate
            and bool(actor.pad_model_input) and actor.input_key == TOKENS_FULL)


def sft_distribution(actor, td: TensorDictBase) -> LLMMaskedCategorical | None:
    """Next-token distributions over ``tokens.full`` (left-padded), masked to each row's response tokens.

    Position ``t`` holds the logits that predicted token ``t`` (position 0 and padding: zeros), as torchrl's
    wrapper aligns them; the mask is the attention mask without each row's prompt. ``None`` when a row's
    attention mask has gaps (the wrapper drops those positions: use its path); rbpipe's rows have none."""
    pad = actor.tokenizer.pad_token_id
    tokens = td.get(TOKENS_FULL, as_padded_tensor=True, padding_side="left", padding_value=pad)
    attention = td.get(ATTENTION_MASK, as_padded_tensor=True, padding_side="left", padding_value=False).bool()
    if not (attention[:, 1:] >= attention[:, :-1]).all():  # not one run of True per row, ending at the right
        return None
    logits = actor.model(tokens, attention)["logits"]
    logits = torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], 1)
    logits = torch.where(attention.unsqueeze(-1), logits, 0.0)
    prompt_lengths = torch.tensor([p.numel() for p in td.get(TOKENS_PROMPT, as_list=True)])
    first = attention.shape[1] - attention.sum(1)  # where each row's tokens start (left padding)
    position = torch.arange(attention.shape[1])
    response = attention & (position >= (first + prompt_lengths).unsqueeze(1))
    return LLMMaskedCategorical(logits=logits, mask=response)
