"""``rbpipe view`` without a browser: what the page's endpoints answer (against ``rbpipe query``), text and
token-only groups, paging, both backends, the ``--html`` file, and bad input refused in one line with nothing
written to the store. The page in a real browser: tests/test_view_browser.py."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from view_helpers import listing, make_store  # noqa: E402

from rbpipe.cli.commands import main  # noqa: E402
from rbpipe.errors import StoreError  # noqa: E402
from rbpipe.storage.query import query  # noqa: E402
from rbpipe.view.source import StoreView, resolve_store  # noqa: E402

CLI = [sys.executable, "-m", "rbpipe.cli"]


@pytest.fixture(scope="module")
def tokens_store(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("view") / "store", 250)


@pytest.fixture(scope="module")
def text_store(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("view") / "store", 12, kind="text")


def test_pages_match_the_groups_view_newest_first(tokens_store):
    view = StoreView(tokens_store)
    want = query(tokens_store, "select seq, group_id, list_avg(returns) as r, members from groups "
                               "order by seq desc").to_pylist()
    seen = []
    for offset in (0, 100, 200):
        page = view.page(None, offset)
        assert page["total"] == 250 and page["newer"] == 0
        seen += [(r["seq"], r["group_id"], r["mean_reward"], r["members"]) for r in page["rows"]]
    assert seen == [(w["seq"], w["group_id"], w["r"], w["members"]) for w in want]
    assert len(view.page(None, 0)["rows"]) == 100  # the browser renders a page, never the store
    first = view.page(None, 0)["rows"][0]
    assert first["prompt_kind"] == "tokens" and first["prompt"] == "9 7 3"  # token ids without text columns


def test_filters_over_both_views_and_a_bad_one(tokens_store):
    view = StoreView(tokens_store)
    for cond in ("list_avg(returns) > 10", "seq % 3 = 0",
                 "seq in (select seq from trajectories where next_reward > 40 and member = 0)"):
        want = [r["seq"] for r in query(tokens_store, f"select seq from groups where {cond} order by seq desc")
                .to_pylist()]
        page = view.page(cond, 0, 1000)
        assert [r["seq"] for r in page["rows"]] == want and page["total"] == len(want) > 0, cond
    for bad in ("list_avg(returns >", "nope > 1", "true; copy (select 1) to 'x.csv'",
                "seq in (select * from read_csv('/etc/hostname'))"):
        with pytest.raises(StoreError) as err:
            view.page(bad)
        assert "\n" not in str(err.value) and str(err.value).startswith("filter"), err.value


def test_a_group_with_its_members_and_the_plot(tokens_store):
    view = StoreView(tokens_store)
    doc = view.group(7)
    want = query(tokens_store, "select member, next_reward, advantage, collector_id, policy_version, "
                               "tokens_response_len from trajectories where seq = 7 order by member").to_pylist()
    assert [{k: m[k] for k in want[0]} for m in doc["members"]] == want
    assert doc["columns"][:4] == ["member", "tokens_response", "next_reward", "advantage"]
    assert [len(m["tokens_response"].split()) if isinstance(m["tokens_response"], str) else
            len(m["tokens_response"]) for m in doc["members"]] == [w["tokens_response_len"] for w in want]
    plot = view.plot("seq < 100")
    stats = query(tokens_store, "select policy_version as v, count(*) as n, avg(next_reward) as r, "
                                "max(advantage) as a from trajectories where seq < 100 group by 1 order by 1")
    assert plot["v"] == stats.column("v").to_pylist() and plot["n"] == stats.column("n").to_pylist()
    assert plot["r_mean"] == pytest.approx(stats.column("r").to_pylist())
    assert plot["a_max"] == pytest.approx(stats.column("a").to_pylist())


@pytest.mark.parametrize("backend", ["arrow", "zarr"])
def test_text_groups_show_their_text(tmp_path, backend):
    store = make_store(tmp_path / "store", 4, kind="text", backend=backend)
    view = StoreView(store)
    row = view.page(None)["rows"][0]
    assert (row["prompt"], row["prompt_kind"]) == ("What is 3 + 3? <b>&", "text")
    doc = view.group(row["seq"])
    assert doc["group"]["group_id"] == 3 and doc["columns"][:2] == ["member", "text_response"]
    assert "finish_reason" in doc["columns"]
    assert [m["text_response"] for m in doc["members"]] == [f"answer {i}: {6 + i}\nbye" for i in range(3)]
    assert [m["finish_reason"] for m in doc["members"]] == ["stop", "length", "stop"]
    want = query(store, "select next_reward, advantage from trajectories where group_id = 3 order by member"
                 ).to_pylist()
    assert [{k: m[k] for k in ("next_reward", "advantage")} for m in doc["members"]] == want


def test_the_view_follows_a_writer(tmp_path):
    """New groups, an eviction and a compaction reach the viewer's ``groups`` view exactly as ``rbpipe query``
    rebuilds it from the whole log, and a page opened earlier stays put."""
    from view_helpers import token_group

    from rbpipe.storage import ArrowStorage
    from rbpipe.storage.query import groups_table
    from rbpipe.trajectory import RAGGED_KEYS

    store = ArrowStorage(tmp_path / "store", ragged_keys=RAGGED_KEYS, max_size=40)  # retention: 10 groups
    try:
        store.append_group(token_group(0))
        view = StoreView(tmp_path / "store")
        page = view.page(None)
        assert page["total"] == 1 and view.state()["last_seq"] == page["rows"][0]["seq"]
        store.append_group(token_group(1))
        store.append_group(token_group(2))
        again = view.page(None, upto=page["upto"])  # the reader's page stays put and counts what is newer
        assert again["total"] == 1 and again["newer"] == 2
        assert [r["group_id"] for r in view.page(None)["rows"]] == [2, 1, 0]
        assert view.group(view.page(None)["rows"][0]["seq"])["members"][3]["member"] == 3
        for gid in range(3, 14):
            store.append_group(token_group(gid))
            assert view.table().equals(groups_table(tmp_path / "store")), gid
        rows = view.page(None, 0, 1000)["rows"]
        assert [r["live"] for r in rows] == [True] * 10 + [False] * 4
        assert [r["prompt_kind"] for r in rows[-4:]] == ["evicted"] * 4
        store.compact()
        assert view.table().equals(groups_table(tmp_path / "store"))
        assert view.group(rows[0]["seq"])["members"][0]["next_reward"] == pytest.approx(13 / 4)
    finally:
        store.close()


def test_resolve_a_run_directory_or_a_store(tmp_path, tokens_store):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"store": str(tokens_store)}))
    assert resolve_store(run) == (tokens_store, run)
    assert resolve_store(tokens_store) == (tokens_store, None)


def test_html_file_is_self_contained_and_holds_the_filtered_groups(tmp_path, text_store):
    before = listing(text_store)
    out = tmp_path / "view.html"
    assert main(["view", str(text_store), "--html", str(out), "--where", "seq % 2 = 0"]) == 0
    text = out.read_text()
    assert f"<title>rbpipe view: {text_store}</title>" in text
    assert not re.search(r"<(script|link|img|iframe)\b[^>]*\b(src|href)\s*=", text), "the file loads something"
    data = json.loads(re.search(r"window\.RBPIPE_DATA = (\{.*?\});</script>", text, re.S).group(1))
    assert [r["seq"] for r in data["page"]["rows"]] == [12, 10, 8, 6, 4, 2]  # seq 0 is the schema record
    assert data["groups"]["4"]["members"][1]["text_response"] == "answer 1: 7\nbye"  # seq 4: group 3
    assert "<b>&" not in text.split("window.RBPIPE_DATA", 1)[1]  # user text cannot end the script
    assert listing(text_store) == before


def _one_line_error(args: list[str], *, timeout: float = 120) -> str:
    out = subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("rbpipe view: error: ") and out.stderr.count("\n") == 1, out.stderr
    return out.stderr


@pytest.mark.timeout(240)
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, tokens_store):
    before = listing(tokens_store)
    (tmp_path / "empty").mkdir()
    assert "neither an rbpipe store" in _one_line_error(["view", str(tmp_path / "empty")])
    assert "does not exist" in _one_line_error(["view", str(tmp_path / "nope")])
    out = tmp_path / "out.html"
    assert "failed" in _one_line_error(["view", str(tokens_store), "--html", str(out), "--where", "returns >"])
    assert not out.exists()
    assert "inside the store" in _one_line_error(["view", str(tokens_store), "--html", str(tokens_store / "v.html")])
    assert "--limit applies only with --html" in _one_line_error(["view", str(tokens_store), "--limit", "5"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert f"port {port} on 127.0.0.1 is in use" in _one_line_error(["view", str(tokens_store), "--port",
                                                                          str(port)])
    assert "not an address of this machine" in _one_line_error(["view", str(tokens_store), "--host", "203.0.113.7"])
    assert listing(tokens_store) == before and sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_bad_flags_are_one_line(tokens_store, tmp_path, capsys):
    for args, words in ((["--port", "70000"], "--port must be in 0..65535"),
                        (["--html", str(tmp_path / "x.html"), "--limit", "-1"], "--limit must be >= 0"),
                        (["--html", str(tmp_path / "no" / "x.html")], "does not exist"),
                        (["--html", str(tmp_path)], "is a directory")):
        assert main(["view", str(tokens_store), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("rbpipe view: error: ") and words in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(240)
def test_server_answers_the_page_and_its_endpoints(tokens_store):
    before = listing(tokens_store)
    proc = subprocess.Popen(CLI + ["view", str(tokens_store), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = re.search(r"at (http://127\.0\.0\.1:\d+/)", line).group(1)
        page = urllib.request.urlopen(url, timeout=60).read().decode()
        assert 'id="groups"' in page and f"<title>rbpipe view: {tokens_store}</title>" in page
        js = urllib.request.urlopen(url + "plotly.min.js", timeout=60).read()
        assert len(js) > 1_000_000
        doc = json.load(urllib.request.urlopen(url + "api/groups?where=seq%20%3C%205", timeout=60))
        assert [r["seq"] for r in doc["rows"]] == [4, 3, 2, 1]  # seq 0 is the schema record
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + "api/groups?where=seq%20%3C", timeout=60)
        assert err.value.code == 400 and json.load(err.value)["error"].startswith("filter")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 0, proc.stderr.read()
    assert listing(tokens_store) == before


def test_every_page_asset_is_package_data():
    """A normal (non-editable) install carries only the files pyproject.toml names: the page, its script and
    its style must all match its package-data patterns (an editable install would hide a missing one)."""
    from fnmatch import fnmatch

    try:
        import tomllib
    except ImportError:  # Python 3.10: pip vendors the same parser
        from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

    root = Path(__file__).resolve().parents[1]
    conf = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = conf["package-data"]["rbpipe.view"]
    package = root / "rbpipe" / "view"
    assets = [p.relative_to(package).as_posix() for p in (package / "static").iterdir()]
    assert {"static/page.html", "static/view.js", "static/view.css"} <= set(assets)
    assert [a for a in assets if not any(fnmatch(a, p) for p in patterns)] == []
    from setuptools.discovery import PackageFinder  # pyproject.toml's package discovery finds the viewer

    assert "rbpipe.view" in PackageFinder.find(str(root), include=conf["packages"]["find"]["include"])
