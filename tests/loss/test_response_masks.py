"""The learner trains on what was said: responses that end at EOS, with a tokenizer whose pad token is EOS
(SmolLM2's), ragged in one batch. In every aggregation mode the gradient is the one of each row's response
tokens, its final EOS included, and of nothing else; both the loss's padded pass and torchrl's wrapper path
agree. Also: models whose second forward parameter is not the attention mask (GPT-2), and the memory a step
keeps for backward on a large vocabulary."""

from __future__ import annotations

import pytest
import torch
from tensordict import lazy_stack

from rbpipe.demo.policy import EOS_ID, build_learner_actor, build_model, build_tokenizer
from rbpipe.demo.task import CopyFirstDigitTask
from rbpipe.loss import LossConfig, build_loss_batch, make_loss, train_step
from rbpipe.loss.logprobs import sft_distribution
from rbpipe.trajectory import make_trajectory

AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
MAX_NEW_TOKENS = 6


def eos_is_pad_tokenizer():
    tok = build_tokenizer()
    tok.pad_token = tok.eos_token
    assert tok.pad_token_id == tok.eos_token_id == EOS_ID
    return tok


def eos_rows(vocab: int, *, seed: int = 0, prompts: int = 3, per_prompt: int = 4):
    """Stored rows whose responses (1-6 tokens) end with EOS, except one cut at the cap (no EOS)."""
    task = CopyFirstDigitTask(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    out, responses = [], []
    for i in range(prompts):
        prompt = task.prompt(i)
        for j in range(per_prompt):
            n = 1 + (i * per_prompt + j) % MAX_NEW_TOKENS
            body = torch.randint(4, vocab, (n,), generator=gen)  # digits only: no EOS inside a response
            stopped = (i, j) != (0, 1)
            response = torch.cat([body[:-1], torch.tensor([EOS_ID])]) if stopped else body
            traj = make_trajectory(group_id=i, prompt=prompt, response=response,
                                   rollout_log_probs=-torch.rand(n, generator=gen), reward=float(j % 2),
                                   collector_id=0, policy_version=0)
            traj.set("advantage", torch.randn(1, 1, generator=gen))
            out += list(traj.unbind(0))
            responses.append((prompt, response))
    return lazy_stack(out), responses


def reference_gradient(model, rows, responses, mode: str) -> list[torch.Tensor]:
    """Each row alone through the model: d/dtheta of the mode's aggregate of ``-A * lp`` over its response
    tokens (at the first update ``r = 1``, so GRPO's gradient is ``-A * dlp``)."""
    model.zero_grad()
    advantages = [float(a.reshape(-1)[0]) for a in rows.get("advantage", as_list=True)]
    per_row = []
    for (prompt, response), adv in zip(responses, advantages, strict=True):
        full = torch.cat([prompt, response]).unsqueeze(0)
        logp = torch.log_softmax(model(input_ids=full).logits[0, :-1].float(), -1)
        taken = logp[prompt.numel() - 1:].gather(-1, response.unsqueeze(-1)).squeeze(-1)
        per_row.append(-adv * taken)
    if mode == "token-mean":
        total = torch.cat(per_row).sum() / sum(r.numel() for r in per_row)
    elif mode == "seq-mean-token-mean":
        total = torch.stack([r.mean() for r in per_row]).mean()
    elif mode == "seq-mean-token-sum":
        total = torch.stack([r.sum() for r in per_row]).mean()
    else:
        total = torch.cat(per_row).sum() / MAX_NEW_TOKENS
    total.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def model():
    return build_model()


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("path", ["padded pass", "torchrl wrapper"])
def test_every_response_token_up_to_its_eos_counts_and_nothing_else(model, mode, path, monkeypatch):
    tok = eos_is_pad_tokenizer()
    actor = build_learner_actor(model, tok)
    if path == "torchrl wrapper":  # as for an actor the padded pass does not cover: torchrl's own distribution
        monkeypatch.setattr("rbpipe.loss.module.covers", lambda actor: False)
        monkeypatch.setattr("rbpipe.loss.batch.covers", lambda actor: False)
    rows, responses = eos_rows(vocab=model.config.vocab_size)
    batch = build_loss_batch(rows, actor=actor)
    loss = make_loss(actor, LossConfig(loss_agg_mode=mode, max_new_tokens=MAX_NEW_TOKENS))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = train_step(loss, opt, batch, micro_batches=2)
    got = [p.grad.detach().clone() for p in model.parameters()]
    assert metrics["valid_tokens"] == sum(r.numel() for _, r in responses), "every response token, EOS included"
    assert metrics["valid_sequences"] == len(responses)
    want = reference_gradient(model, rows, responses, mode)
    assert any(g.abs().max() > 1e-4 for g in want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_final_eos_is_trained_on_when_pad_is_eos(model):
    """The stop token's own log-prob is in the loss: the response mask comes from lengths, never from
    ``tokens != pad_id`` (which would drop every EOS here)."""
    tok = eos_is_pad_tokenizer()
    actor = build_learner_actor(model, tok)
    rows, responses = eos_rows(vocab=model.config.vocab_size, prompts=2, per_prompt=2)
    batch = build_loss_batch(rows, actor=actor)
    with torch.no_grad():
        dist = sft_distribution(actor, batch)
    assert dist is not None
    for i, (_, response) in enumerate(responses):
        row_mask = dist.mask[i]
        assert int(row_mask.sum()) == response.numel()
        assert row_mask[-1], "the last column holds the response's last token (its EOS)"
    lp_old = batch.get(("log_probs", "full"), as_list=True)
    for lp, (_, response) in zip(lp_old, responses, strict=True):
        assert (lp[-response.numel():] != 0).all(), "lp_old of every response token, EOS included"


def test_the_model_is_called_with_keywords_so_gpt2_trains():
    """GPT-2 (transformers 5) takes its cache second: a positional attention mask lands there and fails."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=14, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                      pad_token_id=0, eos_token_id=EOS_ID, bos_token_id=2))
    actor = build_learner_actor(gpt2, eos_is_pad_tokenizer())
    rows, _ = eos_rows(vocab=14, prompts=2, per_prompt=2)
    batch = build_loss_batch(rows, actor=actor)  # lp_old: the recompute pass
    metrics = train_step(make_loss(actor, LossConfig()), torch.optim.SGD(gpt2.parameters(), lr=0.0), batch)
    assert metrics["valid_tokens"] > 0
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in gpt2.parameters())


def test_selective_log_softmax_equals_log_softmax_in_every_precision():
    from rbpipe.loss.logprobs import selective_log_softmax

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 50, generator=gen) * 4
    index = torch.randint(0, 50, (3, 5), generator=gen)
    want = torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(selective_log_softmax(logits, index), want)
    low = selective_log_softmax(logits.bfloat16(), index)
    assert low.dtype == torch.float32, "ratios are taken in float32"
    want_low = torch.log_softmax(logits.bfloat16().float(), -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(low, want_low)


def _full_vocab_tensors_kept(loss, batch, threshold: int, params) -> int:
    """Distinct storages of at least ``threshold`` elements that autograd keeps for backward, parameters
    aside."""
    own = {p.untyped_storage().data_ptr() for p in params}
    kept: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not t.is_nested and t.numel() >= threshold and t.untyped_storage().data_ptr() not in own:
            kept.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = loss(batch)
    sum(out.get(k) for k in out.keys() if k.startswith("loss_")).backward()
    return len(kept)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_a_step_keeps_one_full_vocabulary_tensor_for_backward(entropy_coef, monkeypatch):
    """The logits alone: no float32 log-softmax, no masked or shifted copy, no entropy graph (torchrl's
    ``LLMMaskedCategorical`` path keeps several; measured peaks in bench/RESULTS.md)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = 2048
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=64, pad_token_id=EOS_ID, eos_token_id=EOS_ID))
    actor = build_learner_actor(llama, eos_is_pad_tokenizer())
    rows, responses = eos_rows(vocab=14)
    batch = build_loss_batch(rows, actor=actor, recompute_old=False)
    cfg = LossConfig(entropy_coef=entropy_coef)
    threshold = len(responses) * max(r.numel() for _, r in responses) * vocab // 2
    ours = _full_vocab_tensors_kept(make_loss(actor, cfg, old_from_current=True), batch, threshold,
                                    llama.parameters())
    assert ours == 1
    monkeypatch.setattr("rbpipe.loss.module.covers", lambda actor: False)  # torchrl's _get_sft_dist instead
    theirs = _full_vocab_tensors_kept(make_loss(actor, cfg, old_from_current=True), batch, threshold,
                                      llama.parameters())
    assert theirs > ours, "the check must tell the two paths apart"


def test_micro_batches_keep_activations_within_the_weights():
    """SmolLM2-135M's shape on 32 rows of 72 tokens: 8 micro-batches (its learner peaked at 7.9 GB in one,
    3.7 GB in 8; bench/RESULTS.md); the demo's tiny model stays at one; ``--micro-batches`` is a minimum."""
    from tensordict import TensorDict
    from transformers import LlamaConfig, LlamaForCausalLM

    from rbpipe.loss.batch import auto_micro_batches

    def batch(rows: int, width: int):
        return lazy_stack([TensorDict({"tokens": TensorDict({"full": torch.zeros(width, dtype=torch.long)})})
                           for _ in range(rows)])

    with torch.device("meta"):
        smol = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                            tie_word_embeddings=True))
    assert auto_micro_batches(smol, batch(32, 72)) == 8
    assert auto_micro_batches(smol, batch(2, 2000)) == 2, "never more micro-batches than rows"
    demo = build_model()
    assert auto_micro_batches(demo, batch(64, 12)) == 1
    assert auto_micro_batches(demo, batch(64, 12), minimum=4) == 4
