"""A custom task for ``rbpipe run``: answer with the digit that follows the prompt's last digit.

Train the built-in tiny model on it (from the repository root)::

    rbpipe run --task examples/custom_task.py:NextDigitTask --steps 100

or check the task by itself (prints a few prompts with a right and a wrong answer)::

    python examples/custom_task.py

A task is any object with ``prompt(index) -> 1-D LongTensor`` of token ids and
``reward(prompt, response) -> float``; ``--task`` may also name a class or a function that returns
one (called with ``seed=`` when it takes it). Every rbpipe process builds the task from the spec, so
``prompt(index)`` must depend only on ``index`` (and the seed). The token ids here are those of
rbpipe's built-in model; with ``--model PATH`` use that model's tokenizer instead.
"""

from __future__ import annotations

import torch

from rbpipe.demo.policy import BOS_ID, DIGIT0_ID, EQUALS_ID


class NextDigitTask:
    """Prompt ``<bos> d1 .. dk =`` (1-4 random digits); reward 1.0 when the first response token is
    ``(dk + 1) % 10``, else 0.0.

    Examples:
        >>> task = NextDigitTask(seed=0)
        >>> prompt = task.prompt(3)
        >>> task.reward(prompt, torch.tensor([DIGIT0_ID + (int(prompt[-2]) - DIGIT0_ID + 1) % 10]))
        1.0
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def prompt(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)  # same prompt in every process
        n = int(torch.randint(1, 5, (1,), generator=gen))
        digits = torch.randint(0, 10, (n,), generator=gen) + DIGIT0_ID
        return torch.cat([torch.tensor([BOS_ID]), digits, torch.tensor([EQUALS_ID])])

    def reward(self, prompt: torch.Tensor, response: torch.Tensor) -> float:
        if response.numel() == 0:
            return 0.0
        last = int(prompt[-2]) - DIGIT0_ID
        return float(int(response[0]) == DIGIT0_ID + (last + 1) % 10)


if __name__ == "__main__":
    task = NextDigitTask()
    for i in range(3):
        p = task.prompt(i)
        right = torch.tensor([DIGIT0_ID + (int(p[-2]) - DIGIT0_ID + 1) % 10])
        wrong = torch.tensor([DIGIT0_ID + (int(p[-2]) - DIGIT0_ID + 5) % 10])
        print(f"prompt {i}: {p.tolist()}  reward(right)={task.reward(p, right)}  reward(wrong)={task.reward(p, wrong)}")
    print("train on it: rbpipe run --task examples/custom_task.py:NextDigitTask --steps 100")
