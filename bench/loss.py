"""Loss forward+backward time: rbpipe's GRPOLoss subclass (rollout IS + KL on) vs torchrl's ``GRPOLoss``.

Same tiny model, same batch (stored-row layout, ragged prompts), medians over repeats; prints absolute
milliseconds and the ratio ours / torchrl (goal <= 1.3x). Ours also computes entropy and every spec metric
(mismatch, IS, train-policy) each call; torchrl's baseline runs without its entropy bonus. Never asserts.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from torchrl.objectives.llm import GRPOLoss

from rbpipe.demo.policy import build_learner_actor, build_model, sample_responses
from rbpipe.demo.task import CopyFirstDigitTask
from rbpipe.loss import LossConfig, build_loss_batch, make_loss
from rbpipe.trajectory import make_trajectory


def make_batch(model, actor, ref_actor, rows: int):
    from tensordict import lazy_stack

    task, gen, out = CopyFirstDigitTask(seed=3), torch.Generator().manual_seed(0), []
    for i in range(rows // 8):
        prompt = task.prompt(i)
        tokens, lps = sample_responses(model, prompt, 8, temperature=1.2, generator=gen)
        for t, lp in zip(tokens, lps, strict=True):
            traj = make_trajectory(group_id=i, prompt=prompt, response=t, rollout_log_probs=lp,
                                   reward=task.reward(prompt, t), collector_id=0, policy_version=0)
            traj.set("advantage", torch.randn(1, 1, generator=gen))
            out += list(traj.unbind(0))
    return build_loss_batch(lazy_stack(out), actor=actor, ref_actor=ref_actor)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model()
    actor = build_learner_actor(model)
    ref_actor = build_learner_actor(copy.deepcopy(model).requires_grad_(False))
    batch = make_batch(model, actor, ref_actor, args.rows)
    theirs = GRPOLoss(actor, masking_strategy="sft", entropy_bonus=False, kl_to_ref_coeff=0.05)
    ours = make_loss(actor, LossConfig(kl_coef=0.05, kl_type="k3", rollout_is="token",
                                       rollout_is_threshold=(0.5, 2.0)), ref_actor=ref_actor)

    def run_theirs():
        model.zero_grad()
        out = theirs(batch)
        (out.loss_objective + out.loss_kl_to_ref).backward()

    plain = make_loss(actor, LossConfig())
    theirs_plain = GRPOLoss(actor, masking_strategy="sft", entropy_bonus=False)

    def run_ours():
        model.zero_grad()
        out = ours(batch)
        (out["loss_objective"] + out["loss_kl_to_ref"]).backward()

    def run_plain(loss):
        def run():
            model.zero_grad()
            loss(batch).get("loss_objective").backward()
        return run

    repeats = 5 if args.quick else 30
    t_theirs, t_ours = timed(run_theirs, repeats), timed(run_ours, repeats)
    t_theirs_plain, t_plain = timed(run_plain(theirs_plain), repeats), timed(run_plain(plain), repeats)
    result = {"rows": args.rows, "repeats": repeats, "torchrl_ms": t_theirs * 1e3, "ours_ms": t_ours * 1e3,
              "ratio": t_ours / t_theirs, "torchrl_plain_ms": t_theirs_plain * 1e3, "ours_plain_ms": t_plain * 1e3,
              "ratio_plain": t_plain / t_theirs_plain}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"loss forward+backward, {args.rows} rows, tiny Qwen2, 1 thread (median of {repeats})")
        print(f"  torchrl GRPOLoss (KL to ref):                        {t_theirs * 1e3:8.2f} ms")
        print(f"  rbpipe RbpipeGRPOLoss (token IS + k3 KL + metrics):  {t_ours * 1e3:8.2f} ms")
        print(f"  ratio ours / torchrl: {t_ours / t_theirs:.2f}x (goal <= 1.3x)")
        print(f"  plain GRPO, no KL: torchrl {t_theirs_plain * 1e3:.2f} ms, ours {t_plain * 1e3:.2f} ms, "
              f"ratio {t_plain / t_theirs_plain:.2f}x")


if __name__ == "__main__":
    main()
