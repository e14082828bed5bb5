"""Shared helpers for the grouping tests (module-level so spawn children can import them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tensordict import TensorDict

ROOT = Path(__file__).resolve().parents[2]

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


#: The start of a writer child's script (``python -c``): it joins the manager named in its JSON argument and
#: builds the transform ``t`` of group size 2 on the parent's staging directory and registry name; the rest of
#: the script (appended by the test) is what the child does with it.
WRITER_CHILD = textwrap.dedent("""
    import json, os, signal, sys, time, warnings
    from rbpipe.grouping import SharedMCAdvantage
    from rbpipe.grouping.manager import connect_manager
    from tests.grouping.helpers import MINIMAL_KEYS, traj
    args = json.loads(sys.argv[1])
    manager = connect_manager(args["address"], bytes.fromhex(args["authkey"]))
    t = SharedMCAdvantage(2, prompt_key="group_id", manager=manager, staging_dir=args["staging"],
                          name=args["name"], required_keys=MINIMAL_KEYS)
""")


def writer_child(manager, t, body: str, prefix: tuple[str, ...] = (), **extra) -> subprocess.Popen:
    """Start ``WRITER_CHILD + body`` in its own session, joined to ``manager`` and to ``t``'s staging and name
    (``extra``: more entries of its ``args``; ``prefix``: a command it runs under, e.g. ``unshare``); its stdout
    is a pipe."""
    from rbpipe.grouping.manager import manager_address

    address, authkey = manager_address(manager)
    args = dict(address=address, authkey=authkey.hex(), staging=str(t.staging.path), name=t.registry_name, **extra)
    return child([*prefix, sys.executable, "-c", WRITER_CHILD + textwrap.dedent(body), json.dumps(args)])


def child(cmd: list[str]) -> subprocess.Popen:
    """``cmd`` in its own session, run from the repository root with it on ``PYTHONPATH``; stdout a pipe."""
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))


def recover_within(t, seconds: float) -> list:
    """The claims ``t.recover()`` hands over once there are any (polled), or [] after ``seconds``: a bound for a
    test that would otherwise hang, not a measurement."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        claims = t.recover()
        if claims:
            return claims
        time.sleep(0.05)
    return []


@contextmanager
def lease_manager(monkeypatch, ttl_s: float):
    """A grouping manager of its own whose leases live ``ttl_s`` seconds without a renewal (the children a test
    starts inherit the setting, so their heartbeats match)."""
    from rbpipe.grouping import start_manager

    monkeypatch.setenv("RBPIPE_LEASE_TTL_S", str(ttl_s))
    manager = start_manager()
    try:
        yield manager
    finally:
        manager.shutdown()
