"""Train on an existing store from Python, with no service and no collectors: sample whole groups, run the loss.

    python examples/learner_only.py runs/<run>/store [steps]

The store may be one a finished ``rbpipe run`` left behind (or one a run is still writing). Groups are read
whole, in commit order, each once (``FreshGroupSampler``), exactly as ``rbpipe learner`` reads them.
"""

from __future__ import annotations

import sys

import torch
from torchrl.data import ReplayBuffer

from rbpipe.config import RunConfig
from rbpipe.demo.policy import build_learner_actor
from rbpipe.loss import build_loss_batch, one_update_loss, train_step
from rbpipe.sampling import FreshGroupSampler
from rbpipe.storage import collate_identity, open_storage


def main(store: str, steps: int = 5, groups_per_step: int = 4) -> None:
    cfg = RunConfig()  # the built-in model and the default loss; pass your own settings here
    model, tokenizer = cfg.make_model_and_tokenizer()
    actor = build_learner_actor(model, tokenizer)
    loss_module = one_update_loss(actor, cfg.loss_config())  # one optimizer step per batch, as rbpipe's learner
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    storage = open_storage(store)
    grpo_size = int(storage.group_spans()[0, 2] - storage.group_spans()[0, 1])
    sampler = FreshGroupSampler(num_groups=groups_per_step, max_staleness=None)
    buffer = ReplayBuffer(storage=storage, sampler=sampler, batch_size=groups_per_step * grpo_size,
                          collate_fn=collate_identity)
    for step in range(steps):
        if sampler.available_groups(storage) < groups_per_step:
            print(f"only {sampler.available_groups(storage)} unread groups left; stopping")
            break
        rows = buffer.sample()
        batch = build_loss_batch(rows, actor=actor, recompute_old=not loss_module.old_from_current)
        metrics = train_step(loss_module, optimizer, batch)
        print(f"step {step + 1}: {len(rows)} rows, mean reward {float(rows['next', 'reward'].mean()):.3f}, "
              f"clip fraction {metrics.get('clip_fraction', float('nan')):.3f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
