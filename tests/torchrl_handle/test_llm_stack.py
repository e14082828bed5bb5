"""The handle with torchrl's real LLM pieces on CPU: two collector processes running ``LLMCollector`` +
``TransformersWrapper(generate=True)`` + ``ChatEnv`` write through one handle; the learner (this process)
samples it and trains with torchrl's ``GRPOLoss``, and its reward rises."""

from __future__ import annotations

import multiprocessing
from collections import defaultdict

import pytest
import torch
from text_model import chat_model, chat_tokenizer
from torchrl.objectives.llm import GRPOLoss

import rbpipe
from torchrl_handle.llm_stack import learner_actor, policy_reward, run_collector, with_sampling_log_probs

PROMPTS, REPEATS, GRPO_SIZE = 4, 2, 4  # each collector writes half of every group
# The learner trains as grpo-sync.py does (epochs of a sampler without replacement), on batches of the whole store:
# an update then does not depend on the order in which the collectors' groups landed, which varies from run to run.
# (With 8 random batches of 8 it did: six orders of the same 16 rows gave rises of 0.12-0.27; a clean CI saw 0.01.)
# 8 Adam steps at 3e-2 took the mean reward of 256 seeded samples from 0.102 up by 0.062-0.17 over six collector
# seeds (100-600; 0.100 for the test's), the same in every order tried. MIN_RISE is half the smallest.
LR, EPOCHS, EVAL_SAMPLES, MIN_RISE = 3e-2, 8, 64, 0.03


def _groups(rows) -> dict[str, list]:
    groups = defaultdict(list)
    for row in rows.unbind(0):
        groups[row["query"]].append(row)
    return groups


@pytest.mark.timeout(240)
def test_two_llm_collectors_and_a_grpo_learner(tmp_path):
    rb = rbpipe.replay_buffer(tmp_path / "store", grpo_size=GRPO_SIZE, batch_size=PROMPTS * GRPO_SIZE,
                              prompt_key="query", sampler="without_replacement")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        produced = sum(pool.starmap(run_collector, [(rb, c, PROMPTS, REPEATS, 100 + c) for c in range(2)],
                                    chunksize=1))
    stats = rb.grouping_stats()
    # conservation: every trajectory produced is in the store or still queued (none here: groups complete)
    assert produced == 2 * PROMPTS * REPEATS == len(rb) + stats["queued_trajectories"]
    assert len(rb) == rb.write_count == PROMPTS * GRPO_SIZE
    groups = _groups(rb[:])
    assert len(groups) == PROMPTS
    for members in groups.values():
        assert len(members) == GRPO_SIZE
        writers = {("collector 0" in m["text", "prompt"]) for m in members}
        assert writers == {True, False}  # both collectors in every group
        rewards = torch.stack([m["next", "reward"].reshape(()) for m in members])
        want = (rewards - rewards.mean()) / rewards.std().clamp_min(1e-6)
        got = torch.stack([m["advantage"].reshape(()) for m in members])
        torch.testing.assert_close(got, want)
    # the learner: torchrl's GRPOLoss on the handle's batches, as grpo-sync.py drives it, with the sampling policy's
    # log-probs from a copy of the collectors' weights (chat_model() is seeded: the same model in every process)
    torch.manual_seed(0)
    tokenizer = chat_tokenizer()
    model = chat_model()
    actor, behaviour = learner_actor(model, tokenizer), learner_actor(chat_model(), tokenizer)
    loss_fn = GRPOLoss(actor_network=actor, masking_strategy="sft")
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    start = policy_reward(model, tokenizer, PROMPTS, EVAL_SAMPLES)
    for _ in range(EPOCHS):
        for batch in rb:  # one epoch: every row once
            batch = with_sampling_log_probs(batch, behaviour)
            assert batch.numel() == PROMPTS * GRPO_SIZE
            assert batch.view(-1)[0]["next", "history"].prompt is not None
            loss_fn(batch).loss_objective.backward()
            optim.step()
            optim.zero_grad()
    # the learner's reward rises: its own samples (the same seeded draws before and after) hold more vowels
    end = policy_reward(model, tokenizer, PROMPTS, EVAL_SAMPLES)
    assert end >= start + MIN_RISE, (start, end)
    rb.close()
