"""Collectors generate several prompts' work units in one batched forward (``sample_batch``): prompts of different
lengths are left-padded and masked, and each row must see exactly what it would see alone."""

from __future__ import annotations

import torch

from rbpipe.demo.policy import build_model, sample_batch, sample_responses
from rbpipe.demo.task import CopyFirstDigitTask


def _teacher_forced(model, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``tokens`` after ``prompt``, computed on the unpadded sequence alone."""
    seq = torch.cat([prompt.reshape(1, -1).expand(tokens.shape[0], -1), tokens], 1)
    with torch.no_grad():
        logits = model(input_ids=seq).logits.float()
    logp = torch.log_softmax(logits[:, prompt.numel() - 1:-1], -1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def test_batched_prompts_of_different_lengths_get_the_log_probs_they_would_get_alone():
    model, task = build_model(), CopyFirstDigitTask(seed=0)
    prompts = [task.prompt(i) for i in range(6)]
    assert len({p.numel() for p in prompts}) > 1  # ragged: padding and masks are exercised
    out = sample_batch(model, prompts, [3, 1, 4, 2, 3, 5], max_new_tokens=3,
                       generator=torch.Generator().manual_seed(0))
    for prompt, n, (tokens, log_probs) in zip(prompts, [3, 1, 4, 2, 3, 5], out, strict=True):
        assert tokens.shape == log_probs.shape == (n, 3)
        torch.testing.assert_close(log_probs, _teacher_forced(model, prompt, tokens), atol=1e-5, rtol=0)


def test_one_prompt_is_the_batch_of_one():
    model, prompt = build_model(), CopyFirstDigitTask(seed=1).prompt(0)
    a = sample_responses(model, prompt, 4, max_new_tokens=2, generator=torch.Generator().manual_seed(3))
    (b,) = sample_batch(model, [prompt], [4], max_new_tokens=2, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
