"""Pipeline overhead: time (and learner steps) to reach a mean reward of 0.9.

ceiling  one process: same model, task, samples per step, loss and optimizer; no processes, no shared
         grouping, no storage (advantages from a process-local torchrl MCAdvantage).
ours     ``rbpipe run`` (2 collectors + learner, shared grouping, Arrow store), stopped at the target.

Prints both and the ratio ours / ceiling (goal: <= 3x). ``--quick`` uses a lower target (0.5).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from tensordict import lazy_stack
from torchrl.objectives.llm import MCAdvantage

from rbpipe.config import RunConfig
from rbpipe.loss import LossConfig, build_loss_batch, make_loss, train_step
from rbpipe.policy import build_learner_actor, build_model, sample_responses
from rbpipe.schema import GROUP_KEY, REWARD_KEY, make_trajectory
from rbpipe.task import CopyFirstDigitTask


def ceiling(cfg: RunConfig, target: float, max_steps: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.policy)
    actor = build_learner_actor(model)
    loss_module = make_loss(actor, LossConfig(**cfg.loss), old_from_current=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    grouping = MCAdvantage(grpo_size=cfg.grpo_size, prompt_key=GROUP_KEY, trajectory_return="sum")
    task = CopyFirstDigitTask(seed=cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    t0, index, recent = time.time(), 0, []
    for step in range(1, max_steps + 1):
        groups = []
        while len(groups) < cfg.groups_per_step:
            prompt = task.prompt(index)
            tokens, log_probs = sample_responses(model, prompt, cfg.grpo_size, max_new_tokens=cfg.max_new_tokens,
                                                 temperature=cfg.temperature, generator=gen)
            for response, lp in zip(tokens, log_probs):
                out = grouping.inv(make_trajectory(group_id=index, prompt=prompt, response=response,
                                                   rollout_log_probs=lp, reward=task.reward(prompt, response),
                                                   collector_id=0, policy_version=step - 1))
                if out is not None:
                    groups.append(out)
            index += 1
        rows = lazy_stack([row for g in groups for row in g.unbind(0)])
        batch = build_loss_batch(rows, actor=actor, recompute_old=False)
        train_step(loss_module, optimizer, batch, micro_batches=cfg.micro_batches)
        recent = (recent + [float(rows.get(REWARD_KEY).float().mean())])[-10:]
        if len(recent) == 10 and sum(recent) / 10 >= target:
            return {"seconds": time.time() - t0, "steps": step, "reached": True}
    return {"seconds": time.time() - t0, "steps": max_steps, "reached": False}


def pipeline(cfg: RunConfig, target: float, max_steps: int) -> dict:
    from workers.launcher import launch

    cfg.steps, cfg.target_reward = max_steps, target
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        launch(cfg, run_dir=Path(tmp) / "run", progress=False, log=lambda *a: None)
        wall = time.time() - t0
        metrics = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    last = metrics[-1] if metrics else {"time_s": float("nan"), "step": 0}
    recent = [m["reward_mean"] for m in metrics[-10:]]
    return {"seconds": wall, "learner_seconds": last["time_s"], "steps": last["step"],
            "reached": len(recent) == 10 and sum(recent) / 10 >= target}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="target 0.5 instead of 0.9")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--target", type=float)
    parser.add_argument("--max-steps", type=int, default=800)
    args = parser.parse_args()
    target = args.target or (0.5 if args.quick else 0.9)
    base = ceiling(RunConfig(), target, args.max_steps)
    ours = pipeline(RunConfig(), target, args.max_steps)
    result = {"target": target, "ceiling": base, "ours": ours,
              "ratio_wall": ours["seconds"] / base["seconds"],
              "ratio_learner_time": ours["learner_seconds"] / base["seconds"],
              "ratio_steps": ours["steps"] / base["steps"]}
    if args.json:
        print(json.dumps(result))
        return
    print(f"time to mean reward {target} (10-step average), 2 cores")
    print(f"  ceiling (1 process, no storage): {base['seconds']:7.1f} s  {base['steps']:4d} steps  reached={base['reached']}")
    print(f"  rbpipe run (2 collectors + learner): {ours['seconds']:7.1f} s wall incl. process start, "
          f"{ours['learner_seconds']:.1f} s from the learner's first step, {ours['steps']} steps, reached={ours['reached']}")
    print(f"  ratio ours/ceiling: wall {result['ratio_wall']:.2f}x, learner time {result['ratio_learner_time']:.2f}x, "
          f"steps {result['ratio_steps']:.2f}x")


if __name__ == "__main__":
    main()
