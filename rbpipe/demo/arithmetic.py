"""A procedural, verifiable text task (no download): add two numbers, answer with the number only.

``--task rbpipe.demo.arithmetic:AdditionTask`` (``digits=2`` by default: ``"What is 47 + 85? ..."``). The reward
pays 1.0 for a response that is exactly the sum (spaces and a final period aside), 0.5 for a response that
contains the sum among other words, 0.0 otherwise. Why this shape: a small chat model (SmolLM2-135M-Instruct)
mostly answers with a sentence and often a wrong sum, so it starts well below 0.5 (``bench/RESULTS.md``), and the
half reward for a right sum inside a sentence gives its first groups a signal to learn from before it learns the
format. ``prompt(i)`` depends only on ``(seed, i)``: every process rebuilds the same prompts.

:func:`exact_answer` is the matching ``--reward`` for a data file with an ``answer`` column.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

_NUMBER = re.compile(r"-?\d+")
_QUESTION = re.compile(r"What is (-?\d+) \+ (-?\d+)\?")


def score_answer(response: str, answer: int | str) -> float:
    """1.0 for exactly ``answer`` (surrounding spaces and one final period aside), 0.5 when ``answer`` is one of
    the numbers in ``response``, else 0.0.

    Examples:
        >>> score_answer(" 132.", 132), score_answer("47 + 85 = 132", 132), score_answer("131", 132)
        (1.0, 0.5, 0.0)
    """
    want = str(answer).strip()
    text = response.strip()
    if text.endswith("."):
        text = text[:-1].rstrip()
    if text == want:
        return 1.0
    return 0.5 if want in _NUMBER.findall(response.replace(",", "")) else 0.0


def exact_answer(prompt: Any, response: str, answer: Any = None, **_: Any) -> float:
    """A data file's reward (``--reward rbpipe.demo.arithmetic:exact_answer``): :func:`score_answer` against
    the row's ``answer`` column; other columns are ignored."""
    if answer is None:
        raise ValueError("exact_answer needs an 'answer' column in the data file")
    return score_answer(response, answer)


@dataclass(frozen=True)
class AdditionTask:
    """``prompt(i)``: ``"What is A + B? Reply with the number only."`` (A, B of ``digits`` digits, seeded by
    ``(seed, i)``); ``reward(prompt, response)``: :func:`score_answer` against A + B, read back from the prompt.

    Examples:
        >>> task = AdditionTask(seed=0)
        >>> task.prompt(0)
        'What is 54 + 19? Reply with the number only.'
        >>> task.reward(task.prompt(0), "73"), task.reward(task.prompt(0), "It is 73."), task.reward("", "1")
        (1.0, 0.5, 0.0)
    """

    seed: int = 0
    digits: int = 2

    def prompt(self, index: int) -> str:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + int(index))
        low, high = 10 ** (self.digits - 1), 10 ** self.digits
        a, b = (int(x) for x in torch.randint(low, high, (2,), generator=gen))
        return f"What is {a} + {b}? Reply with the number only."

    @staticmethod
    def reward(prompt: str, response: str) -> float:
        found = _QUESTION.search(prompt)
        if found is None:
            return 0.0
        return score_answer(response, int(found.group(1)) + int(found.group(2)))


def final_number(response: str) -> str | None:
    """The last integer in ``response`` (commas inside numbers ignored), as graders of GSM8K-style tasks extract
    a final answer; ``None`` when there is none.

    Examples:
        >>> final_number("7 + 5 = 12."), final_number("It is 1,204"), final_number("twelve")
        ('12', '1204', None)
    """
    numbers = _NUMBER.findall(response.replace(",", ""))
    return numbers[-1] if numbers else None


@dataclass(frozen=True)
class SingleDigitAdditionTask:
    """``prompt(i)``: :class:`AdditionTask`'s one-digit prompt (``"What is 7 + 5? Reply with the number only."``);
    ``reward(prompt, response)``: 1.0 when the response's final number is the sum, else 0.0.

    Why a second task: this is the one the README's real-model run learns on 2 CPU cores within the hour.
    SmolLM2-135M-Instruct answers in sentences ("7 + 5 = 12.") and, sampled at temperature 1, often rambles past
    the cap or gets the sum wrong, so it starts near 0.27 (``bench/RESULTS.md``); both a right sum and a short
    answer raise the reward, which groups of 8 samples tell apart from the first step. :class:`AdditionTask`
    asks for the exact format on two digits, which this model almost never produces (base score 0.01-0.02).

    Examples:
        >>> task = SingleDigitAdditionTask(seed=0)
        >>> task.prompt(0)
        'What is 9 + 1? Reply with the number only.'
        >>> task.reward(task.prompt(0), "9 + 1 = 10."), task.reward(task.prompt(0), "10 is 9 + 1")
        (1.0, 0.0)
    """

    seed: int = 0

    def prompt(self, index: int) -> str:
        return AdditionTask(seed=self.seed, digits=1).prompt(index)

    @staticmethod
    def reward(prompt: str, response: str) -> float:
        found = _QUESTION.search(prompt)
        if found is None:
            return 0.0
        return float(final_number(response) == str(int(found.group(1)) + int(found.group(2))))
