"""The loss's own padded forward pass (``rbpipe.loss.logprobs``) against torchrl's ``actor._get_sft_dist``:
same masks, log-probs, entropies and gradients on ragged rows (prompts of 2-5 tokens, responses of 1-3)."""

from __future__ import annotations

import pytest
import torch
from torchrl.modules.llm import TransformersWrapper

from rbpipe.demo.policy import build_learner_actor, build_model, build_tokenizer
from rbpipe.loss import LossConfig, build_loss_batch, make_loss
from rbpipe.loss.logprobs import covers, sft_distribution
from tests.loss.test_loss_module import grads, rows


@pytest.fixture(scope="module")
def setup():
    model = build_model()
    return model, build_learner_actor(model)


def test_the_response_distribution_equals_torchrls_in_value_and_gradient(setup):
    model, actor = setup
    batch = build_loss_batch(rows(model, prompts=5, per_prompt=3), actor=actor)
    action = batch.get(("tokens", "full"), as_padded_tensor=True, padding_side="left", padding_value=-100)
    results = []
    for get_dist in (lambda td: sft_distribution(actor, td), actor._get_sft_dist):
        model.zero_grad()
        dist = get_dist(batch.copy())
        log_prob = dist.log_prob(action)
        (log_prob.sum() + 0.1 * dist.entropy().sum()).backward()
        results.append((dist.mask, log_prob.detach(), dist.entropy().detach(), grads(model)))
    (mask, lp, ent, g), (mask_t, lp_t, ent_t, g_t) = results
    assert torch.equal(mask, mask_t)
    assert mask.any(-1).all() and not mask.all(), "every row has response tokens, and prompts are masked out"
    torch.testing.assert_close(lp, lp_t, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, ent_t, rtol=1e-5, atol=1e-6)
    for a, b in zip(g, g_t, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_an_actor_the_padded_pass_does_not_cover_goes_through_torchrls_wrapper(setup):
    """Packed model input (no padding) gives slightly different logits for left-padded rows: the loss must then
    use the wrapper's own distribution, not the padded pass."""
    model, actor = setup
    packed = TransformersWrapper(model, tokenizer=build_tokenizer(), input_mode="tokens", generate=False,
                                 return_log_probs=True, pad_output=False, pad_model_input=False)
    assert covers(actor) and not covers(packed)
    batch = build_loss_batch(rows(model, prompts=4, per_prompt=4), actor=actor)
    action = batch.get(("tokens", "full"), as_padded_tensor=True, padding_side="left", padding_value=-100)
    with torch.no_grad():
        used, _, _ = make_loss(packed, LossConfig())._get_cur_log_prob(batch.copy())
        wrapper = packed._get_sft_dist(batch.copy()).log_prob(action)
        padded = sft_distribution(packed, batch.copy()).log_prob(action)
    torch.testing.assert_close(used, wrapper, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(used, padded, rtol=1e-5, atol=1e-6), "the two passes must be told apart here"


def test_rows_whose_attention_mask_has_gaps_are_left_to_torchrls_wrapper(setup):
    model, actor = setup
    batch = build_loss_batch(rows(model, prompts=2, per_prompt=2), actor=actor)
    assert sft_distribution(actor, batch) is not None
    batch[1].set(("masks", "all_attention_mask"), torch.tensor([True, False] + [True] * 10)[
        : batch[1].get(("tokens", "full")).numel()])
    assert sft_distribution(actor, batch) is None
