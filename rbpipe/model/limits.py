"""What a model can take: the token ids it embeds and the positions it covers (a task's prompts and
``--max-new-tokens`` are checked against them before a run starts, and a collector caps its sampling)."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch


def vocab_size(model: torch.nn.Module) -> int:
    """Token ids a model can embed (the limit a task's prompts must respect)."""
    # torch types a module attribute as ``Tensor | Module``: this one is transformers' method
    get_embeddings = cast("Callable[[], torch.nn.Embedding]", model.get_input_embeddings)
    return int(get_embeddings().weight.shape[0])


def max_positions(model: torch.nn.Module) -> int | None:
    """The longest sequence the model's position embeddings cover, when its config says."""
    value = getattr(model.config, "max_position_embeddings", None)
    return int(value) if value else None
