"""Shared checks of the Ray tests: run ``rbpipe run --engine ray`` against the test cluster, read the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

PINS = json.dumps({"learner": {"head": 0.01}, "collectors": [{"node_b": 0.01}, {"node_c": 0.01}]})


def ray_env() -> dict:
    """The environment of the runs the tests start: a 3 s lease, so a killed collector's claims move on sooner
    (set for those runs only: other tests keep the default)."""
    return dict(os.environ, RBPIPE_LEASE_TTL_S="3")


def ray_run_cmd(address: str, run_dir: Path, *extra: str, steps: int = 6, shards: int = 2) -> list[str]:
    return [sys.executable, "-m", "rbpipe.cli", "run", "--no-progress", "--json", "--engine", "ray",
            "--ray-address", address, "--grouping-shards", str(shards), "--ray-resources", PINS,
            "--run-dir", str(run_dir), "--steps", str(steps), "--grpo-size", "4", "--groups-per-step", "2",
            "--collectors", "2", *extra]


def check_store(run_dir: Path, summary: dict) -> list[dict]:
    """Every stored group whole, stored once, advantages = group-normalised returns; returns the groups."""
    out = subprocess.run([sys.executable, "-m", "rbpipe.cli", "inspect", str(run_dir / "store"), "--json",
                          "--limit", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    groups = json.loads(out.stdout)["groups"]
    assert len(groups) == summary["groups_written"] > 0
    ids = [g["group_id"] for g in groups]
    assert len(set(ids)) == len(ids), "a group was stored twice"
    for g in groups:
        returns = torch.tensor(g["returns"], dtype=torch.float64)
        assert len(returns) == summary["grpo_size"], "a torn group"
        expected = (returns - returns.mean()) / returns.std().clamp_min(1e-6)
        torch.testing.assert_close(torch.tensor(g["advantages"], dtype=torch.float64), expected,
                                   atol=1e-5, rtol=1e-5)
    return groups
