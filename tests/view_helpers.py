"""Shared by the viewer's tests: small stores made in-process (token-only and text groups) and a listing of a
store's files that proves the viewer wrote nothing there."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tensordict import NonTensorData, lazy_stack

from rbpipe.trajectory import RAGGED_KEYS, make_trajectory


def token_group(gid: int, n: int = 4, version: int = 1):
    """A group as the demo writes it: token ids only, rewards 0..n-1 shifted by the group id."""
    g = torch.Generator().manual_seed(gid)
    trajs = []
    for i in range(n):
        t = make_trajectory(group_id=gid, prompt=torch.tensor([gid % 10, 7, 3]),
                            response=torch.randint(0, 50, (2 + i,), generator=g),
                            rollout_log_probs=torch.randn(2 + i, generator=g), reward=float(i + gid) / n,
                            collector_id=i % 2, policy_version=version + gid // 5)
        t["advantage"] = torch.full((1, 1), float(i) - (n - 1) / 2)
        trajs.append(t)
    return lazy_stack([s for t in trajs for s in t.unbind(0)], 0)


def text_group(gid: int, n: int = 3):
    """A text group: the prompt, each response and its finish reason as string fields beside the tokens."""
    group = token_group(gid, n)
    steps = []
    for i in range(n):
        step = group[i].clone()
        step["text"] = {"prompt": NonTensorData(f"What is {gid} + {gid}? <b>&"),
                        "response": NonTensorData(f"answer {i}: {2 * gid + i}\nbye")}
        step["finish_reason"] = NonTensorData("stop" if i % 2 == 0 else "length")
        steps.append(step)
    return lazy_stack(steps, 0)


def make_store(path: Path, groups: int, kind: str = "tokens", backend: str = "arrow") -> Path:
    from rbpipe.storage import ArrowStorage, ZarrStorage

    cls = ArrowStorage if backend == "arrow" else ZarrStorage
    store = cls(path, ragged_keys=RAGGED_KEYS)
    for gid in range(groups):
        store.append_group(token_group(gid) if kind == "tokens" else text_group(gid))
    store.close()
    return path


def listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(dirpath, f))
            out[os.path.relpath(os.path.join(dirpath, f), root)] = (st.st_size, st.st_mtime_ns)
    return out
