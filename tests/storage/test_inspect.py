"""``rbpipe inspect``: DuckDB SQL in ``--where``, whole groups on screen, and an answer without torch."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from helpers_storage import llm_group

from rbpipe.cli.tables import format_groups
from rbpipe.errors import StoreError
from rbpipe.storage import ArrowStorage, inspect_store

RAGGED = [("tokens", "prompt"), ("tokens", "response"), ("log_probs", "rollout")]


@pytest.fixture
def store(tmp_path):
    s = ArrowStorage(tmp_path / "s", ragged_keys=RAGGED, catalog_every=2)
    for gid in range(5):
        s.append_group(llm_group(gid))  # returns gid .. gid+3
    s.close()
    return tmp_path / "s"


def test_where_is_duckdb_sql_over_the_groups_view(store):
    assert [g["group_id"] for g in inspect_store(store, where="group_id >= 3")["groups"]] == [3, 4]
    assert inspect_store(store, where="list_avg(returns) > 4.4")["groups_matched"] == 2
    both = inspect_store(store, where="list_max(returns) >= 5 and members = 4 or group_id = 0")
    assert [g["group_id"] for g in both["groups"]] == [0, 2, 3, 4]
    assert inspect_store(store, where="group_id = 1", group=2)["groups_matched"] == 0


def test_a_bad_where_is_one_line_that_names_the_fix(store):
    with pytest.raises(StoreError, match="--where") as err:
        inspect_store(store, where="__import__('os')")
    assert "\n" not in str(err.value)
    with pytest.raises(StoreError, match=r"list_avg\(returns\)"):  # the old filter language points to SQL
        inspect_store(store, where="returns_mean > 0.5")


def test_an_eight_member_group_is_shown_whole_and_long_lists_wrap():
    adv = [-1.87, 1.23, -0.5, 0.25, 2.0, -0.01, 0.75, -1.0]
    g8 = {"group_id": 7, "members": 8, "returns": [float(i) for i in range(8)], "advantages": adv,
          "collectors": [0.0, 1.0] * 4, "policy_versions": [3.0] * 8}
    g32 = {"group_id": 8, "members": 32, "returns": [0.5] * 32, "advantages": [-0.123] * 32,
           "collectors": [1.0] * 32, "policy_versions": [12.0] * 32}
    text = format_groups([g8, g32])
    assert "~" not in text
    first = [line for line in text.splitlines() if line.lstrip().startswith("7 ")]
    assert len(first) == 1
    assert all(f"{a:+.2f}" in text for a in adv)
    assert text.count("-0.12") == 32 and text.count("12") >= 32
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120
    continuation = [line for line in lines if line[:14].strip() == ""]
    assert continuation, "a 32-member group wraps onto continuation lines"


def _make_store(path, groups: int):
    s = ArrowStorage(path, ragged_keys=RAGGED)
    for gid in range(groups):
        s.append_group(llm_group(gid, n=8))
    s.close()


@pytest.mark.timeout(300)
def test_inspect_of_2400_groups_is_fast_and_never_imports_torch(tmp_path):
    _make_store(tmp_path / "big", 2400)
    code = ("import sys, time; t = time.perf_counter(); from rbpipe.cli.commands import main; "
            f"rc = main(['inspect', {str(tmp_path / 'big')!r}, '--where', 'list_avg(returns) > 0']); "
            "print(f'elapsed={time.perf_counter() - t:.3f}', file=sys.stderr); "
            "assert 'torch' not in sys.modules, 'inspect imported torch'; sys.exit(rc)")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    assert "groups=2400" in out.stdout
    print(f"inspect of 2400 groups: {out.stderr.strip()} in-process, {wall:.2f} s wall with interpreter start")
    assert wall < 5.0
    info = json.loads(subprocess.run([sys.executable, "-m", "rbpipe.cli", "inspect", str(tmp_path / "big"),
                                      "--json", "--limit", "3"], capture_output=True, text=True).stdout)
    assert info["groups_committed"] == 2400 and len(info["groups"]) == 3


def test_the_cli_shows_every_advantage_of_an_eight_member_group(tmp_path, capsys):
    from rbpipe.cli.commands import main

    _make_store(tmp_path / "s", 3)
    assert main(["inspect", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "~" not in out
    for g in inspect_store(tmp_path / "s")["groups"]:
        assert len(g["advantages"]) == 8
        assert all(f"{a:+.2f}" in out for a in g["advantages"])


def test_inspect_piped_into_head_ends_quietly(tmp_path):
    """``rbpipe inspect STORE | head``: the reader leaves early; no BrokenPipeError traceback, exit code 0."""
    _make_store(tmp_path / "s", 1000)  # far more output than a pipe buffers
    out = subprocess.run(f"{sys.executable} -m rbpipe.cli inspect {tmp_path / 's'} --limit 0 | head -n 1",
                         shell=True, capture_output=True, text=True, timeout=120,
                         executable="/bin/bash")  # (head's status is the pipeline's; check rbpipe's via PIPESTATUS)
    assert len(out.stdout.splitlines()) == 1
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
    status = subprocess.run(f"{sys.executable} -m rbpipe.cli inspect {tmp_path / 's'} --limit 0 | head -n 1 "
                            f">/dev/null; echo ${{PIPESTATUS[0]}}", shell=True, capture_output=True, text=True,
                            timeout=120, executable="/bin/bash")
    assert status.stdout.strip() == "0", status.stderr
