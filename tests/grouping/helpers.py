"""Shared helpers for the grouping tests (module-level so spawn children can import them)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

MINIMAL_KEYS = ("group_id", ("next", "reward"), ("next", "done"))


def traj(uid: int, group: int, rewards: list[float]) -> TensorDict:
    steps = len(rewards)
    done = torch.zeros(steps, 1, dtype=torch.bool)
    done[-1] = True
    return TensorDict({"group_id": torch.full((steps,), group, dtype=torch.int64),
                       "uid": torch.full((steps,), uid, dtype=torch.int64),
                       "next": TensorDict(reward=torch.tensor(rewards, dtype=torch.float32).reshape(steps, 1),
                                          done=done, batch_size=[steps])}, batch_size=[steps])


def groups_of(out) -> list[tuple]:
    """Canonical form of a transform output: (group, sorted (uid, advantages)) per group."""
    if out is None:
        return []
    rows = {}
    uids = out.get("uid").tolist()
    advs = out.get("advantage").reshape(len(uids), -1)[:, 0].tolist()
    gids = out.get("group_id").tolist()
    for u, a, g in zip(uids, advs, gids, strict=True):
        rows.setdefault((g, u), []).append(a)
    by_group: dict = {}
    for (g, u), a in rows.items():
        by_group.setdefault(g, []).append((u, tuple(a)))
    return [(g, tuple(sorted(m))) for g, m in by_group.items()]


def writer_main(buffer, items) -> None:
    torch.set_num_threads(1)
    for uid, group, rewards in items:
        buffer.extend(traj(uid, group, rewards))
