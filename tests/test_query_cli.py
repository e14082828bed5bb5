"""``rbpipe query STORE SQL``: DuckDB over the ``groups`` and ``trajectories`` views, as text, JSON or CSV."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "storage"))
from helpers_storage import llm_group  # noqa: E402

from rbpipe.cli.commands import build_parser, main  # noqa: E402
from rbpipe.storage import ArrowStorage  # noqa: E402
from rbpipe.storage.query import query  # noqa: E402
from rbpipe.trajectory import RAGGED_KEYS  # noqa: E402


@pytest.fixture
def store(tmp_path):
    s = ArrowStorage(tmp_path / "s", ragged_keys=RAGGED_KEYS)
    for gid in range(3):
        s.append_group(llm_group(gid, n=8))
    s.close()
    return tmp_path / "s"


def test_json_is_one_document_with_columns_and_rows(store, capsys):
    assert main(["query", str(store), "select group_id, count(*) as n from trajectories group by 1 order by 1",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"columns": ["group_id", "n"], "rows": [{"group_id": g, "n": 8} for g in range(3)]}


def test_text_table_and_csv(store, capsys):
    assert main(["query", str(store), "select count(*) as trajectories from trajectories"]) == 0
    text = capsys.readouterr().out
    assert text.split() == ["trajectories", "-" * len("trajectories"), "24", "(1", "row)"]
    assert main(["query", str(store), "select group_id, returns from groups order by seq", "--csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == ["group_id", "returns"] and len(rows) == 4
    assert json.loads(rows[1][1]) == [float(i) for i in range(8)]


def test_help_lists_both_views_and_every_column(store, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["query", "--help"])
    text = capsys.readouterr().out
    for view in ("groups", "trajectories"):
        for name in query(store, f"select * from {view} limit 0").column_names:
            assert name in text, f"{view}.{name} missing from rbpipe query --help"


def test_bad_sql_is_a_one_line_error(store, capsys):
    assert main(["query", str(store), "select nope from trajectories"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rbpipe query: error: query failed") and err.count("\n") == 1
