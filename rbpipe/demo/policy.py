"""The tiny causal LM used by collectors and learner, built from a config in code (no downloads).

A 2-layer ``Qwen2`` model over a 14-token vocabulary and a ``tokenizers`` WordLevel tokenizer. Rollouts
use a short explicit sampling loop so the rollout log-probs are exact; the learner recomputes
log-probs through torchrl's ``TransformersWrapper`` (``generate=False``), which ``GRPOLoss`` drives.
``--model PATH`` swaps the built-in model for a local Hugging Face directory (:func:`load_pretrained`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

PAD_ID, EOS_ID, BOS_ID, EQUALS_ID, DIGIT0_ID = 0, 1, 2, 3, 4
VOCAB = {"<pad>": PAD_ID, "<eos>": EOS_ID, "<bos>": BOS_ID, "=": EQUALS_ID,
         **{str(d): DIGIT0_ID + d for d in range(10)}}


@dataclass(frozen=True)
class PolicyConfig:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 32
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def build_tokenizer():
    """A WordLevel tokenizer over digits and a few specials, made in code."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")


def build_model(cfg: PolicyConfig = PolicyConfig()) -> torch.nn.Module:
    """A randomly initialised Qwen2ForCausalLM, identical for the same config (seeded)."""
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    transformers.logging.set_verbosity_error()
    config = Qwen2Config(
        vocab_size=len(VOCAB), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_positions,
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID, tie_word_embeddings=True,
    )
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        model = Qwen2ForCausalLM(config)
    return model.eval()


def load_pretrained(path: str | Path, *, with_tokenizer: bool = True) -> tuple[torch.nn.Module, Any]:
    """A causal LM (float32, on the CPU) and its tokenizer from a local ``save_pretrained`` directory or a
    ``.gguf`` file (``--model PATH``).

    Never downloads (``local_files_only``): a run must not depend on the network. A GGUF file is converted
    once into a plain directory that every later load reads (:mod:`rbpipe.model.gguf`). The weights come back in
    float32 whatever dtype the directory was saved in: the learner's optimizer needs float32 master weights,
    and collectors cast to ``--dtype`` themselves. Any failure is a one-line :class:`~rbpipe.errors.ConfigError`.

    Examples:
        >>> import tempfile
        >>> path = tempfile.mkdtemp()
        >>> build_model().save_pretrained(path); build_tokenizer().save_pretrained(path)  # doctest: +ELLIPSIS
        (...)
        >>> model, tokenizer = load_pretrained(path)
        >>> model.config.model_type
        'qwen2'
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rbpipe.errors import ConfigError
    from rbpipe.model.gguf import ensure_converted, is_gguf

    path = Path(path).expanduser()
    if is_gguf(path):
        path = ensure_converted(path)
    if not path.is_dir():
        raise ConfigError(f"--model {path}: no such directory; pass a local directory written by "
                          "model.save_pretrained() and tokenizer.save_pretrained(), or a .gguf file")
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {path}: no config.json there; pass a directory written by "
                          "model.save_pretrained() (with its tokenizer)")
    if with_tokenizer and not any((path / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
        # transformers would quietly make an empty tokenizer: refuse instead
        raise ConfigError(f"--model {path}: no tokenizer there (tokenizer_config.json); save it next to the model "
                          "with tokenizer.save_pretrained(PATH)")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    what = "model"
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        what = "tokenizer"
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True) if with_tokenizer else None
    except Exception as err:  # noqa: BLE001 - transformers raises many types; all mean "not loadable"
        text = " ".join(str(err).split())[:300]
        raise ConfigError(f"--model {path}: cannot load the {what} ({type(err).__name__}: {text}); pass a "
                          "causal-LM directory saved with save_pretrained() together with its tokenizer") from err
    return model.float().eval(), tokenizer


def build_learner_actor(model: torch.nn.Module, tokenizer: Any = None):
    """torchrl's TransformersWrapper in log-prob mode: the ``actor_network`` of ``GRPOLoss``
    (``tokenizer``: the model's own; ``None`` = the built-in one)."""
    from torchrl.modules.llm import TransformersWrapper

    return TransformersWrapper(model, tokenizer=build_tokenizer() if tokenizer is None else tokenizer,
                               input_mode="tokens", generate=False, return_log_probs=True, pad_output=False)


def sample_responses(model: torch.nn.Module, prompt: torch.Tensor, num_samples: int, *,
                     max_new_tokens: int = 3, temperature: float = 1.0,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``num_samples`` responses to one prompt; return ``(tokens, log_probs)``, each ``[n, R]``.

    The log-probs are those of the *sampling* distribution (softmax(logits / temperature)): what a
    rollout engine reports, which rollout importance sampling compares with the learner's.
    """
    return sample_batch(model, [prompt], [num_samples], max_new_tokens=max_new_tokens, temperature=temperature,
                        generator=generator)[0]


@torch.no_grad()
def sample_batch(model: torch.nn.Module, prompts: Sequence[torch.Tensor], counts: Sequence[int], *,
                 max_new_tokens: int = 3, temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`sample_responses` for several prompts in one forward pass per token: ``counts[i]`` responses to
    ``prompts[i]``, returned as one ``(tokens, log_probs)`` pair per prompt.

    A tiny model's forward costs about the same for 4 rows as for 32, so a collector that generates several
    work units at once pays for one. Every response is ``max_new_tokens`` long (no stop token); responses that
    stop at EOS or a stop string come from :func:`rbpipe.model.generation.generate`, which this calls.
    """
    from rbpipe.model.generation import Sampling, generate

    out = generate(model, prompts, counts, Sampling(max_new_tokens=max_new_tokens, temperature=temperature),
                   pad_id=PAD_ID, generator=generator)
    return [(torch.stack([r.tokens for r in rows]), torch.stack([r.log_probs for r in rows])) for rows in out]


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one float32 vector on the CPU (what the learner publishes, whatever its device)."""
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()]).cpu()


def load_flat_parameters(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy a published vector into ``model``, cast to each parameter's dtype (one transfer to its device)."""
    first = next(model.parameters(), None)
    if first is not None and flat.device != first.device:
        flat = flat.to(first.device)
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p))
            offset += n
