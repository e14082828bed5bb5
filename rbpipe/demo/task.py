"""A verifiable task a tiny LM learns in minutes on a CPU: copy the first digit of the prompt.

A prompt is ``<bos> d1 d2 ... dk =`` with 2-5 random digits (so prompts have ragged lengths);
the reward is 1.0 when the first response token is ``d1``, else 0.0. A random policy scores ~0.07.
It is the default ``--task``, spelled ``rbpipe.demo.task:CopyFirstDigitTask`` (see :mod:`rbpipe.model.task_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rbpipe.demo.policy import BOS_ID, DIGIT0_ID, EQUALS_ID


@dataclass(frozen=True)
class CopyFirstDigitTask:
    """Prompts and reward; ``prompt(i)`` is deterministic in ``(seed, i)`` so any process can rebuild it."""

    seed: int = 0
    min_digits: int = 2
    max_digits: int = 5

    def prompt(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n = int(torch.randint(self.min_digits, self.max_digits + 1, (1,), generator=gen))
        digits = torch.randint(0, 10, (n,), generator=gen)
        return torch.cat([torch.tensor([BOS_ID]), digits + DIGIT0_ID, torch.tensor([EQUALS_ID])])

    @staticmethod
    def reward(prompt: torch.Tensor, response: torch.Tensor) -> float:
        return float(response.numel() > 0 and int(response[0]) == int(prompt[1]))
