"""Learner peak memory with a real vocabulary: rbpipe's loss against torchrl's distribution path, one run.

Each variant runs in a fresh process (peak resident memory, ``VmHWM``, only grows): it builds the model, then
trains ``--steps`` learner steps (Adam, the learner's default loss: GRPO with token-level rollout IS) on
``--rows`` rows whose responses end with EOS, and reports its peak against the model's weights + gradients +
Adam states (4 float32 copies of the parameters). Variants:

* ``torchrl``: the loss's current log-probs from torchrl's ``TransformersWrapper._get_sft_dist``
  (``LLMMaskedCategorical`` over padded logits; the entropy metric through torchrl's ``_get_entropy``);
* ``rbpipe``: the loss's own padded pass (``rbpipe.loss.logprobs``: logits of the response span only, the taken
  tokens' log-probs row by row, the entropy without gradient);
* ``rbpipe-mb4``: the same in 4 micro-batches;
* ``rbpipe-auto``: the same in the learner's own number of micro-batches (``auto_micro_batches``: one
  micro-batch's activations within max(weights, 256 MB)).

The default model is a Llama config of ~42.5M parameters with SmolLM2's vocabulary (49,152); ``--model FILE``
trains a real one (e.g. SmolLM2-135M-Instruct's GGUF). Memory is not noisy on a shared machine; time is, so
step times are printed but not compared. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

VARIANTS = ("torchrl", "rbpipe", "rbpipe-mb4", "rbpipe-auto")


def _model(path: str | None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if path:
        from rbpipe.demo.policy import load_pretrained

        return load_pretrained(path, with_tokenizer=False)[0]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=5,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=2, eos_token_id=2, bos_token_id=1)
    return LlamaForCausalLM(config)


def _rows(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int):
    import torch
    from tensordict import lazy_stack

    from rbpipe.trajectory import make_trajectory

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        n = response_len - (i % 8)  # ragged, each ending with EOS (id 2, also the pad id)
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen)
        response = torch.cat([torch.randint(3, vocab, (n - 1,), generator=gen), torch.tensor([2])])
        traj = make_trajectory(group_id=i // 8, prompt=prompt, response=response,
                               rollout_log_probs=-torch.rand(n, generator=gen) * 3, reward=float(i % 2),
                               collector_id=0, policy_version=0)
        traj.set("advantage", torch.randn(1, 1, generator=gen))
        out += list(traj.unbind(0))
    return lazy_stack(out)


def _tokenizer():
    from rbpipe.demo.policy import build_tokenizer

    return build_tokenizer()  # the wrapper reads its pad id only; masks come from lengths


def run_variant(variant: str, args) -> dict:
    """One variant in this process; returns its figures."""
    import torch
    from torchrl.modules.llm import TransformersWrapper

    import rbpipe.loss.module as loss_module_code
    from rbpipe.config import DEFAULT_LOSS
    from rbpipe.loss import LossConfig, build_loss_batch, make_loss, train_step
    from rbpipe.loss.batch import auto_micro_batches
    from rbpipe.tracking.memory import peak_rss_mb

    torch.set_num_threads(args.threads)
    model = _model(args.model).float().train()
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    actor = TransformersWrapper(model, tokenizer=_tokenizer(), input_mode="tokens", generate=False,
                                return_log_probs=True, pad_output=False)
    if variant == "torchrl":
        loss_module_code.covers = lambda actor: False  # type: ignore[assignment]  # torchrl's _get_sft_dist
    cfg = LossConfig(**{"max_new_tokens": args.response_len, **DEFAULT_LOSS})  # the learner's default loss
    loss = make_loss(actor, cfg, old_from_current=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    before = peak_rss_mb()
    times = []
    for step in range(args.steps):
        rows = _rows(args.rows, args.prompt_len, args.response_len, vocab, seed=step)
        t = time.perf_counter()
        batch = build_loss_batch(rows, actor=actor, recompute_old=False)
        micro = {"rbpipe-mb4": 4, "rbpipe-auto": auto_micro_batches(model, batch)}.get(variant, 1)
        train_step(loss, optimizer, batch, micro_batches=micro)
        times.append(time.perf_counter() - t)
    peak = peak_rss_mb() or 0.0
    state_mb = 4 * params * 4 / 1e6
    return {"variant": variant, "params": params, "vocab": vocab, "rows": args.rows,
            "width": args.prompt_len + args.response_len, "peak_rss_mb": peak, "rss_before_steps_mb": before,
            "weights_grads_adam_mb": round(state_mb, 1), "peak_over_state": round(peak / state_mb, 2),
            "micro_batches": micro, "step_s": [round(x, 2) for x in times]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 step per variant, 16 rows")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--model", help="a model directory or .gguf file (default: a 42.5M Llama, vocab 49,152)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=15)
    parser.add_argument("--response-len", type=int, default=57)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant here
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rows = 1, 16
    if args.variant:
        print(json.dumps(run_variant(args.variant, args)))
        return
    passthrough = [f"--rows={args.rows}", f"--prompt-len={args.prompt_len}", f"--response-len={args.response_len}",
                   f"--steps={args.steps}", f"--threads={args.threads}"] + ([f"--model={args.model}"]
                                                                          if args.model else [])
    results = []
    for variant in args.variants.split(","):
        out = subprocess.run([sys.executable, __file__, f"--variant={variant}", *passthrough],
                             capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        if not args.json:
            r = results[-1]
            print(f"{r['variant']:>11}: peak {r['peak_rss_mb']:8.1f} MB = {r['peak_over_state']:.2f} x weights+grads+"
                  f"Adam ({r['weights_grads_adam_mb']:.0f} MB); steps {r['step_s']} s", flush=True)
    base = next((r for r in results if r["variant"] == "torchrl"), None)
    report = {"results": results,
              "peak_ratio_rbpipe_over_torchrl": (round(next(r["peak_rss_mb"] for r in results
                                                            if r["variant"] == "rbpipe") / base["peak_rss_mb"], 3)
                                                 if base and any(r["variant"] == "rbpipe" for r in results)
                                                 else None)}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"peak rbpipe / torchrl: {report['peak_ratio_rbpipe_over_torchrl']}")


if __name__ == "__main__":
    main()
