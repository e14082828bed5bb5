"""``bench/storage.py --quick --json`` prints the report other tools parse (the issue's contract)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_storage_bench_json_report():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "storage.py"), "--quick", "--json"],
                         capture_output=True, text=True, timeout=280, check=True).stdout
    report = json.loads(out)  # stdout is the JSON object alone
    assert report["default_backend"] == "arrow"
    seen = {(r["backend"], r["workload"], r["op"]) for r in report["results"]}
    for backend in ("memmap", "arrow", "zarr"):
        for workload in ("llm_groups", "rl_rows"):
            for op in ("write", "sample"):
                assert (backend, workload, op) in seen
    assert all(r["throughput"] > 0 for r in report["results"])
