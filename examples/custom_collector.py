"""Your own collector loop, attached to a running ``rbpipe serve`` (what ``rbpipe collector`` does, in 30 lines).

In one shell::

    rbpipe serve --run-dir runs/shared --steps 100

in a second one (as many as you like, at any time)::

    python examples/custom_collector.py runs/shared

and in a third::

    rbpipe learner --connect runs/shared

The service hands out *work units* (a prompt index and how many of its samples to generate); the samples of
one prompt come from several collectors and the service groups them, computes the group-relative advantages
and stores whole groups. ``client.extend`` validates each trajectory exactly as rbpipe's own collectors do.
"""

from __future__ import annotations

import sys
import time

import torch

import rbpipe
from rbpipe.demo.policy import sample_responses
from rbpipe.schema import make_trajectory


def main(target: str) -> None:
    with rbpipe.connect(target) as client:  # reads RUN_DIR/endpoint.json and the key beside it
        cfg = client.config                 # the service's settings: task spec, model, grpo_size, ...
        policy, task = cfg.make_model(), cfg.make_task()
        version = client.load_weights(policy)
        print(f"collector {client.collector_id} attached to {client.run_dir}")
        while not client.stop_requested():
            unit = client.take()            # None while the rate limit holds new prompts back
            if unit is None:
                time.sleep(0.05)
                continue
            if client.weights_version != version:
                version = client.load_weights(policy)
            prompt = task.prompt(unit["prompt"])
            responses, log_probs = sample_responses(policy, prompt, unit["samples"],
                                                    max_new_tokens=cfg.max_new_tokens)
            client.extend([make_trajectory(  # the whole unit in one hand-over (one round trip)
                group_id=unit["prompt"], prompt=prompt, response=response, rollout_log_probs=lp,
                reward=float(task.reward(prompt, response)), collector_id=client.collector_id,
                policy_version=version) for response, lp in zip(responses, log_probs, strict=True)])
    print("the service asked its workers to stop")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/shared")
