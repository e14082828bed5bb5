"""End to end: ``rbpipe run`` with real collector and learner processes, then the store read back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

RUN = [sys.executable, "-m", "rbpipe.cli", "run", "--no-progress"]


def run_cli(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    out = run_cli(RUN + ["--run-dir", str(run_dir), "--steps", "8", "--grpo-size", "4",
                         "--groups-per-step", "2", "--collectors", "2"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run_dir


@pytest.mark.timeout(300)
def test_summary_has_the_contract_fields_and_conservation_holds(short_run):
    summary = json.loads((short_run / "summary.json").read_text())
    for key in ("produced", "written", "dropped", "unselected", "queued", "groups_written", "groups_dropped",
                "grpo_size", "learner_steps", "reward_first20", "reward_last20", "duration_s"):
        assert key in summary, key
    assert summary["learner_steps"] == 8
    assert summary["produced"] == (summary["written"] + summary["dropped"] + summary["unselected"]
                                   + summary["queued"] + summary["rejected"])
    assert summary["conservation_ok"] is True
    assert summary["written"] == summary["groups_written"] * 4
    assert (short_run / "reward.png").stat().st_size > 1000
    # --steps alone runs every step: no target
    assert summary["target_reward"] is None and summary["reached_target"] is False
    records = [json.loads(line) for line in (short_run / "metrics.jsonl").read_text().splitlines()]
    assert summary["reward_last10"] == pytest.approx(sum(r["reward_mean"] for r in records[-10:]) / len(records[-10:]))
    # where the time went, per step and for the run
    for r in records:
        for key in ("learner/data_wait_s", "learner/sample_s", "learner/train_s", "learner/publish_s",
                    "learner/busy_fraction", "learner/policy_lag", "collectors/generate_s", "collectors/handover_s",
                    "learner/collectors_rate_limited_s"):
            assert r[key] >= 0, key
    timing = summary["timing"]
    assert timing["learner_train_s"] == pytest.approx(sum(r["learner/train_s"] for r in records), abs=1e-2)
    assert timing["learner_sample_s"] == pytest.approx(sum(r["learner/sample_s"] for r in records), abs=1e-2)
    assert timing["collectors_generate_s"] > 0 and 0 < timing["learner_busy_fraction_mean"] <= 1


@pytest.mark.timeout(300)
def test_a_run_stops_once_the_target_reward_is_reached_and_says_so(tmp_path):
    run_dir = tmp_path / "run"
    out = run_cli(RUN + ["--run-dir", str(run_dir), "--steps", "200", "--target-reward", "0.01", "--grpo-size", "4",
                         "--groups-per-step", "2", "--collectors", "1"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reached_target"] is True and summary["reward_last10"] >= 0.01
    assert 10 <= summary["learner_steps"] < 200
    assert "the task is learned" in out.stdout


@pytest.mark.timeout(300)
def test_stored_groups_are_whole_cross_writer_and_correctly_normalised(short_run):
    out = run_cli([sys.executable, "-m", "rbpipe.cli", "inspect", str(short_run / "store"), "--json",
                   "--limit", "0"])
    assert out.returncode == 0, out.stderr
    groups = json.loads(out.stdout)["groups"]
    summary = json.loads((short_run / "summary.json").read_text())
    assert len(groups) == summary["groups_written"] > 0
    ids = [g["group_id"] for g in groups]
    assert len(set(ids)) == len(ids), "a group id was stored twice"
    for g in groups:
        returns = torch.tensor(g["returns"], dtype=torch.float64)
        assert len(returns) == 4
        expected = (returns - returns.mean()) / returns.std().clamp_min(1e-6)
        torch.testing.assert_close(torch.tensor(g["advantages"], dtype=torch.float64), expected,
                                   atol=1e-5, rtol=1e-5)
        assert sorted(set(int(c) for c in g["collectors"])) == [0, 1], "members must come from both collectors"
    # the catalogue is plain Parquet: readable without rbpipe
    table = pq.read_table(str(short_run / "store" / "catalog"))
    assert table.num_rows == len(groups)


@pytest.mark.timeout(300)
def check_trained_rows(run_dir: Path, groups: int) -> None:
    """The learner trained on exactly the rows the collectors stored: its per-group fingerprints in
    ``metrics.jsonl`` (``trained_groups``) against ones computed here, row by row, from the store."""
    from rbpipe.storage import open_storage
    from rbpipe.trajectory import GROUP_KEY, PROMPT_TOKENS_KEY, RESPONSE_TOKENS_KEY

    storage = open_storage(run_dir / "store")
    stored: dict[int, list[int]] = {}
    rows = storage.get(torch.arange(len(storage)))
    for row in rows.unbind(0):
        gid = int(row.get(GROUP_KEY).reshape(-1)[0])
        entry = stored.setdefault(gid, [gid, 0, 0])
        entry[1] += 1
        entry[2] += int(row.get(PROMPT_TOKENS_KEY).sum()) + 3 * int(row.get(RESPONSE_TOKENS_KEY).sum())
    trained = [g for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               for g in json.loads(line)["trained_groups"]]
    assert len(trained) == groups
    assert len({g[0] for g in trained}) == len(trained), "a group was trained on twice"
    for gid, members, checksum in trained:
        assert stored[gid] == [gid, members, checksum]


def test_learner_read_exactly_the_rows_the_collectors_wrote(short_run):
    check_trained_rows(short_run, groups=8 * 2)


@pytest.mark.timeout(300)
def test_dynamic_sampling_that_drops_most_groups_does_not_stall_the_run(tmp_path):
    """Dropped groups never reach the learner; the collectors' lead must still advance past them (it used
    to be measured against trained groups only, so a few more drops than ``lead_groups`` stalled the run)."""
    run_dir = tmp_path / "run"
    out = run_cli(RUN + ["--run-dir", str(run_dir), "--steps", "10", "--grpo-size", "4", "--groups-per-step", "2",
                         "--keep-return-bounds", "0.01", "0.99"], timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    lead_groups = 2 * (4 - 1)  # groups_per_step * (max_policy_lag - 1), the default lead
    assert summary["learner_steps"] == 10
    assert summary["groups_dropped"] > lead_groups, "the run must drop enough groups to have stalled before"
    assert summary["conservation_ok"], summary
    groups = json.loads(run_cli([sys.executable, "-m", "rbpipe.cli", "inspect", str(run_dir / "store"),
                                 "--json", "--limit", "0"]).stdout)["groups"]
    assert groups and all(0.01 < sum(g["returns"]) / len(g["returns"]) < 0.99 for g in groups)
