"""Generation and learner throughput on one model: rbpipe's collector sampling vs Hugging Face ``generate``.

Both sides sample the same model, batch, temperature and lengths in one run, interleaved (theirs, ours, theirs,
ours...), medians reported: every row generates exactly ``--new-tokens`` tokens (no stop token on either side), so
tokens/s compare the loops, not where random responses happened to stop. Also the learner's tokens/s per step
(rbpipe's loss, backward and Adam step on a batch of the same shape) and its achieved FLOP/s, counted as
6 x parameters x tokens, against this machine's fp32 matmul peak measured in the same run on the same number of
threads. Prints absolute figures and ratios; never asserts.

    python bench/generation.py --json --quick             # the demo model
    python bench/generation.py --json --model DIR          # a save_pretrained directory (or what --model takes)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _model(path: str | None):
    from rbpipe.config import RunConfig

    return RunConfig(model=path).make_model_and_tokenizer() if path else RunConfig().make_model_and_tokenizer()


def matmul_peak(threads: int, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an ``n x n`` fp32 matmul on ``threads`` threads (the best of ``repeats``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        best = min(_time(lambda: a @ b) for _ in range(repeats))
    finally:
        torch.set_num_threads(before)
    return 2 * n ** 3 / best


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def generation(model, tokenizer, *, batch: int, prompt_len: int, new_tokens: int, repeats: int,
               temperature: float) -> dict:
    """tokens/s of :func:`rbpipe.model.generation.generate` and of ``model.generate`` (sampling, KV cache)."""
    from rbpipe.model.generation import Sampling, generate

    vocab = int(model.get_input_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, vocab, (prompt_len,), generator=gen) for _ in range(batch)]
    ids = torch.stack(prompts)
    sampling = Sampling(max_new_tokens=new_tokens, temperature=temperature)
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0

    def ours() -> None:
        out = generate(model, prompts, [1] * batch, sampling, pad_id=pad, generator=gen)
        assert all(r[0].tokens.numel() == new_tokens for r in out)

    def theirs() -> None:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=pad, use_cache=True)
        assert out.shape[1] == prompt_len + new_tokens

    ours(), theirs()  # warm-up
    t_ours, t_theirs = [], []
    for _ in range(repeats):
        t_theirs.append(_time(theirs))
        t_ours.append(_time(ours))
    tokens = batch * new_tokens
    ours_tps, theirs_tps = tokens / statistics.median(t_ours), tokens / statistics.median(t_theirs)
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "temperature": temperature,
            "repeats": repeats, "ours_tokens_per_s": round(ours_tps, 1),
            "hf_generate_tokens_per_s": round(theirs_tps, 1),
            "ratio_ours_over_hf": round(ours_tps / theirs_tps, 3)}


def learner(model, tokenizer, *, rows: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    """One learner step (rbpipe's loss batch, GRPO loss, backward, Adam) per repeat: tokens/s and FLOP/s."""
    from tensordict import lazy_stack

    from rbpipe.demo.policy import build_learner_actor
    from rbpipe.loss import LossConfig, build_loss_batch, make_loss, train_step
    from rbpipe.trajectory import make_trajectory

    vocab = int(model.get_input_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(1)
    actor = build_learner_actor(model, tokenizer)
    loss = make_loss(actor, LossConfig(rollout_is="token", max_new_tokens=new_tokens), old_from_current=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    out = []
    for i in range(rows):
        traj = make_trajectory(group_id=i // 8, prompt=torch.randint(4, vocab, (prompt_len,), generator=gen),
                               response=torch.randint(4, vocab, (new_tokens,), generator=gen),
                               rollout_log_probs=-torch.rand(new_tokens, generator=gen) - 1, reward=0.0,
                               collector_id=0, policy_version=0)
        traj.set("advantage", torch.randn(1, 1, generator=gen))
        out += list(traj.unbind(0))
    rows_td = lazy_stack(out)
    model.train()

    def step() -> None:
        batch = build_loss_batch(rows_td, actor=actor, recompute_old=False)
        train_step(loss, optimizer, batch)

    step()  # warm-up
    best = statistics.median(_time(step) for _ in range(repeats))
    model.eval()
    tokens = rows * (prompt_len + new_tokens)
    params = sum(p.numel() for p in model.parameters())
    return {"rows": rows, "tokens_per_step": tokens, "step_s": round(best, 4), "tokens_per_s": round(tokens / best, 1),
            "parameters": params, "achieved_flops": 6 * params * tokens / best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory (default: the demo's built-in model)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, help="tokens per response (default 24; the demo model: 16)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens (default 32; the demo model: 8)")
    parser.add_argument("--learner-rows", type=int, help="rows per learner step (default: 4 x --batch)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = _model(args.model)
    positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    prompt_len = args.prompt_len or (8 if args.model is None else 32)
    new_tokens = args.new_tokens or (16 if args.model is None else 24)
    if positions:
        new_tokens = min(new_tokens, positions - prompt_len)
    repeats = 3 if args.quick else 7
    gen = generation(model, tokenizer, batch=args.batch, prompt_len=prompt_len, new_tokens=new_tokens,
                     repeats=repeats, temperature=1.0)
    print(f"generation done: {gen}", file=sys.stderr, flush=True)
    learn = learner(model, tokenizer, rows=args.learner_rows or args.batch * 4, prompt_len=prompt_len,
                    new_tokens=new_tokens, repeats=repeats)
    peak = matmul_peak(args.threads)
    report = {"model": args.model or "demo", "threads": args.threads, "generation": gen,
              "learner": {**learn, "matmul_peak_flops": peak,
                          "fraction_of_peak": round(learn["achieved_flops"] / peak, 3)}}
    if args.json:
        print(json.dumps(report))
        return
    print(f"model {report['model']}, {args.threads} thread(s)")
    print(f"generation: rbpipe {gen['ours_tokens_per_s']:.0f} tokens/s, HF generate "
          f"{gen['hf_generate_tokens_per_s']:.0f} tokens/s, ratio {gen['ratio_ours_over_hf']:.2f}")
    print(f"learner: {learn['tokens_per_s']:.0f} tokens/s ({learn['step_s'] * 1e3:.0f} ms/step), "
          f"{learn['achieved_flops'] / 1e9:.1f} GFLOP/s = {report['learner']['fraction_of_peak']:.0%} of the "
          f"{peak / 1e9:.0f} GFLOP/s matmul peak")


if __name__ == "__main__":
    main()
