"""A tiny chat model made in code for the text-task tests: a character-level tokenizer with a ChatML-style chat
template (``<|im_start|>`` / ``<|im_end|>``, EOS = ``<|im_end|>``) and a 1-layer Qwen2 whose EOS logit is fixed at
0, so that about one sampled token in 45 is EOS: responses of 24 tokens at most end by EOS about half the time."""

from __future__ import annotations

import string
from pathlib import Path

import torch

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
PAD_ID, START_ID, EOS_ID = 0, 1, 2
CHARS = list(string.ascii_lowercase + string.digits + " \n?+=.")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer(template: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    if template:
        out.chat_template = TEMPLATE
    return out


def chat_model(seed: int = 0, positions: int = 96):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(SPECIALS) + len(CHARS), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=positions, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
                         bos_token_id=START_ID, tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[EOS_ID] = 0  # EOS logit 0 among random others: sampled now and then
    return model.eval()


def save_chat_model(path: Path, *, template: bool = True, positions: int = 96) -> Path:
    chat_model(positions=positions).save_pretrained(path)
    chat_tokenizer(template).save_pretrained(path)
    return path
