"""Shared builders for storage tests (imported by path: tests/storage is on sys.path via conftest)."""

from __future__ import annotations

import torch
from tensordict import lazy_stack

from rbpipe.trajectory import make_trajectory


def llm_group(gid: int, n: int = 4, seed: int = 0, version: int = 1):
    g = torch.Generator().manual_seed(seed * 1000 + gid)
    trajs = []
    for i in range(n):
        L = int(torch.randint(1, 12, (), generator=g))
        t = make_trajectory(group_id=gid, prompt=torch.randint(0, 50, (3,), generator=g),
                            response=torch.randint(0, 50, (L,), generator=g),
                            rollout_log_probs=torch.randn(L, generator=g), reward=float(i + gid),
                            collector_id=gid % 3, policy_version=version)
        t["advantage"] = torch.randn(1, 1, generator=g)
        trajs.append(t)
    return lazy_stack([s for t in trajs for s in t.unbind(0)], 0)
