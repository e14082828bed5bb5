"""Text prompts to token ids (the model's chat template applied) and response tokens back to text.

A task's ``prompt(index)`` may return token ids (a 1-D integer tensor), a ``str`` (one user message) or chat
messages (``[{"role": ..., "content": ...}]``). Why one object per process does the encoding: every collector
must turn the same prompt into the same ids with the model's own tokenizer and template, and the launcher must
refuse at start what would fail in every worker (messages without a template, prompts too long for the model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rbpipe.errors import ConfigError

#: what a text task's prompt may be (a token-level task's is a tensor)
PROMPT_SHAPES = ("a 1-D LongTensor of token ids, a str (one user message) or chat messages "
                 "[{'role': 'user', 'content': '...'}]")


def is_messages(prompt: Any) -> bool:
    return (isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes)) and len(prompt) > 0
            and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in prompt))


def is_text_prompt(prompt: Any) -> bool:
    """A prompt that the tokenizer encodes (a str or chat messages), not token ids."""
    return isinstance(prompt, str) or is_messages(prompt)


@dataclass
class Encoded:
    """A prompt as the model sees it: ``ids`` (1-D int64) and ``text`` (template applied; None for a token-level
    task's ids, which are not text)."""

    ids: torch.Tensor
    text: str | None


class PromptEncoder:
    """Encodes a task's prompts for one model: ids unchanged; a str or messages through the chat template when
    the tokenizer has one and ``chat_template`` is on, else the text as it is (messages then refused).

    Examples:
        >>> from rbpipe.demo.policy import build_tokenizer
        >>> PromptEncoder(build_tokenizer()).encode("12=").ids.tolist()
        [5, 6, 3]
    """

    def __init__(self, tokenizer: Any, *, chat_template: bool = True, task_name: str = "the task") -> None:
        self.tokenizer = tokenizer
        self.template = bool(chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None))
        self.chat_template = chat_template
        self.task_name = task_name

    def encode(self, prompt: Any) -> Encoded:
        if isinstance(prompt, torch.Tensor):
            return Encoded(prompt.reshape(-1).to(torch.int64), None)
        if not is_text_prompt(prompt):
            raise ConfigError(f"{self.task_name}: prompt() returned a {type(prompt).__name__}; it must return "
                              f"{PROMPT_SHAPES}")
        if self.tokenizer is None:
            raise ConfigError(f"{self.task_name}: text prompts need the model's tokenizer")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.template:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, str):
            text = prompt
            ids = self.tokenizer(text)["input_ids"]
        else:
            why = ("--no-chat-template was given" if not self.chat_template
                   else "the model's tokenizer has no chat template")
            raise ConfigError(f"{self.task_name}: prompt() returned chat messages but {why}; return a str instead, "
                              "or use a model whose tokenizer has a chat_template (tokenizer.chat_template = ...)")
        if not ids:
            raise ConfigError(f"{self.task_name}: the prompt {str(prompt)[:60]!r} encodes to no tokens")
        return Encoded(torch.tensor(ids, dtype=torch.int64), text)

    def decode(self, tokens: torch.Tensor) -> str:
        """A response's text as a reward sees it: special tokens (EOS among them) skipped."""
        return str(self.tokenizer.decode(tokens.tolist(), skip_special_tokens=True))
