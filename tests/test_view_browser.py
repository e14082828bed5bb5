"""``rbpipe view`` in a real browser (headless Chromium through Selenium and Debian's chromedriver).

A short ``rbpipe run`` writes a store; ``rbpipe view`` serves it on a free loopback port; the page's group table
is checked against ``rbpipe query`` (ids and mean rewards of the first page), a group is opened and its members
checked, filters are applied (a bad one shows a one-line error on the page), and new groups appear without a
reload while a second writer appends to the same store. Then the same checks on the ``--html`` file.

Chromium and chromedriver come from Debian (``.ci/run`` installs them). Without them the test skips on a
developer's machine and fails in CI (``CI`` set): a viewer test that never runs would prove nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

sys.path.insert(0, str(Path(__file__).parent))
from view_helpers import listing  # noqa: E402

from tests.process_helpers import terminate  # noqa: E402

CLI = [sys.executable, "-m", "rbpipe.cli"]
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SMALL_RUN = ["--steps", "4", "--collectors", "2", "--groups-per-step", "2", "--no-progress"]
WAIT_S = 180  # for a condition the page reaches by itself (a poll, a writer); never a sleep


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _rbpipe_query(store: Path, sql: str) -> list[dict]:
    """What ``rbpipe query STORE SQL --json`` prints, run in this process (the command's own functions: a
    process per query only added its start-up, a dozen times)."""
    from rbpipe.storage.query import query, to_json

    return json.loads(to_json(query(store, sql)))["rows"]


def _run(args: list[str], timeout: float = 280) -> None:
    out = subprocess.run(CLI + ["run", *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("viewrun") / "run1"
    _run(["--run-dir", str(run_dir), *SMALL_RUN])
    return run_dir


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        msg = (f"{' and '.join(missing)} missing: apt-get install -y --no-install-recommends chromium "
               "chromium-driver (as .ci/run does)")
        if _in_ci():
            pytest.fail(msg)
        pytest.skip(msg)
    home = tmp_path_factory.mktemp("chromium")
    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                "--disable-extensions", "--disable-background-networking", "--disable-sync",
                "--disable-component-update", "--window-size=1400,1000", f"--user-data-dir={home / 'profile'}"):
        opts.add_argument(arg)
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(home), "XDG_CONFIG_HOME": str(home / "config"),
           "XDG_CACHE_HOME": str(home / "cache")}
    # the driver's path is given: Selenium never looks for (or downloads) one
    service = Service(executable_path=CHROMEDRIVER, env=env, log_output=subprocess.DEVNULL)
    driver = webdriver.Chrome(service=service, options=opts)
    driver.set_page_load_timeout(120)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def served(first_run):
    """``rbpipe view RUN_DIR --port 0``: the URL it prints (a free loopback port, no race for one)."""
    proc = subprocess.Popen(CLI + ["view", str(first_run), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
        assert m, line + proc.stderr.read()
        yield m.group(1)
    finally:
        terminate(proc)
    assert proc.returncode == 0, proc.stderr.read()


def _wait(driver, cond, what: str, timeout: float = WAIT_S):
    def safe(d):
        try:
            return cond(d)
        except StaleElementReferenceException:  # the table was re-rendered between two reads
            return False
    return WebDriverWait(driver, timeout, poll_frequency=0.2, ignored_exceptions=()).until(safe, what)


def _table(driver) -> list[dict]:
    """The group table as the page shows it (the machine contract: data-group-id on each row)."""
    rows = driver.execute_script(
        "return Array.from(document.querySelectorAll('#groups tbody tr')).map(tr => ({"
        "gid: tr.getAttribute('data-group-id'), seq: tr.dataset.seq, mean: tr.dataset.meanReward, "
        "cells: Array.from(tr.cells).map(td => td.textContent)}))")
    return rows


def _ready(driver) -> None:
    _wait(driver, lambda d: d.execute_script("return document.body.dataset.ready === '1'"), "page loaded")


def _check_first_page(driver, store: Path, where: str = "true") -> list[dict]:
    want = _rbpipe_query(store, f"select seq, group_id, list_avg(returns) as r from groups where {where} "
                                "order by seq desc limit 100")
    _wait(driver, lambda d: [int(r["seq"]) for r in _table(d)] == [w["seq"] for w in want],
          f"the table to show {len(want)} groups")
    rows = _table(driver)
    assert [r["gid"] for r in rows] == [str(w["group_id"]) for w in want]
    assert [float(r["mean"]) for r in rows] == pytest.approx([w["r"] for w in want], rel=1e-12)
    assert [r["cells"][4] for r in rows] == [f"{w['r']:.4f}" for w in want]  # the mean reward column
    assert all(r["cells"][2] for r in rows), "every group shows its prompt (token ids in the demo)"
    return want


def _check_a_group(driver, store: Path, seq: int) -> None:
    row = driver.find_element(By.CSS_SELECTOR, f"#groups tbody tr[data-seq='{seq}']")
    row.click()
    want = _rbpipe_query(store, "select member, next_reward, advantage, collector_id, policy_version from "
                                f"trajectories where seq = {seq} order by member")
    _wait(driver, lambda d: d.find_element(By.ID, "group").get_attribute("data-seq") == str(seq)
          and len(d.find_elements(By.CSS_SELECTOR, "#members tbody tr")) == len(want), "the group's members")
    head = [th.text for th in driver.find_elements(By.CSS_SELECTOR, "#members thead th")]
    got = driver.execute_script("return Array.from(document.querySelectorAll('#members tbody tr'))"
                                ".map(tr => Array.from(tr.cells).map(td => td.textContent))")
    assert len(got) == len(want) > 0
    for cells, w in zip(got, want, strict=True):
        shown = dict(zip(head, cells, strict=True))
        for key in ("member", "collector_id", "policy_version"):
            assert shown[key] == str(w[key]), (key, shown, w)
        for key in ("next_reward", "advantage"):
            assert float(shown[key]) == pytest.approx(w[key], abs=1e-4), (key, shown, w)
        assert shown["tokens_response"], "the response (token ids of the demo's token-only groups)"


def _apply(driver, cond: str) -> None:
    box = driver.find_element(By.ID, "filter")
    box.clear()
    box.send_keys(cond)
    driver.find_element(By.ID, "apply").click()


@pytest.mark.timeout(900)
def test_live_page_table_group_filters_and_new_groups(first_run, served, browser):
    store = first_run / "store"
    browser.get(served)
    _ready(browser)
    assert str(store) in browser.title
    want = _check_first_page(browser, store)
    _check_a_group(browser, store, want[len(want) // 2]["seq"])
    assert browser.execute_script("return document.querySelectorAll('#plot .main-svg').length") > 0

    _apply(browser, "seq % 2 = 0")
    _check_first_page(browser, store, "seq % 2 = 0")
    _apply(browser, "seq in (select seq from trajectories where next_reward > 0)")
    _check_first_page(browser, store, "seq in (select seq from trajectories where next_reward > 0)")
    shown = [r["seq"] for r in _table(browser)]
    _apply(browser, "list_avg(returns >")  # does not parse: one line on the page, the table stays
    err = _wait(browser, lambda d: d.find_element(By.ID, "filter-error").text, "the filter's error")
    assert "\n" not in err and err.startswith("filter") and "list_avg(returns >" in err
    assert [r["seq"] for r in _table(browser)] == shown
    browser.find_element(By.ID, "clear").click()
    _wait(browser, lambda d: not d.find_element(By.ID, "filter-error").is_displayed(), "the error to go")
    before = _check_first_page(browser, store)

    # a second writer appends to the same store while the page is open (it takes the writer lock and holds it
    # until the page has shown its groups: the viewer never needs it); its groups are copies of the run's own,
    # so the schema is the run's
    from rbpipe.storage import open_storage

    writer = open_storage(store)
    try:
        _, a, b = writer.group_spans()[0].tolist()
        first = writer.get(slice(a, b))
        for _ in range(3):
            writer.append_group(first)
        newest = before[0]["seq"]
        _wait(browser, lambda d: int(_table(d)[0]["seq"]) > newest, "a new group at the top, without a reload")
    finally:
        writer.close()
    total = _rbpipe_query(store, "select count(*) as n from groups")[0]["n"]
    _wait(browser, lambda d: d.find_element(By.ID, "total").text == str(total), "every group of both writers")
    _check_first_page(browser, store)


@pytest.mark.timeout(600)
def test_html_file_shows_the_same_without_a_server(first_run, browser, tmp_path):
    store = first_run / "store"
    before = listing(store)
    for where in (None, "seq % 2 = 0"):
        out = tmp_path / f"view{'-filtered' if where else ''}.html"
        args = CLI + ["view", str(first_run), "--html", str(out)] + (["--where", where] if where else [])
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "wrote" in done.stdout, done.stderr
        browser.get(out.as_uri())
        _ready(browser)
        assert str(store) in browser.title
        want = _check_first_page(browser, store, where or "true")
        _check_a_group(browser, store, want[-1]["seq"])
        assert browser.execute_script("return document.querySelectorAll('#plot .main-svg').length") > 0
        # nothing was fetched: no server, no network
        assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
        assert browser.find_element(By.ID, "filter").get_attribute("value") == (where or "")
    assert listing(store) == before


@pytest.mark.timeout(300)
def test_text_groups_show_their_text_in_the_page(browser, tmp_path):
    """A store with text columns (``text_prompt``, ``text_response``, ``finish_reason``): the page shows the text,
    newlines and markup included as written (never interpreted as HTML)."""
    from view_helpers import make_store

    store = make_store(tmp_path / "store", 3, kind="text")
    out = tmp_path / "text.html"
    done = subprocess.run(CLI + ["view", str(store), "--html", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    browser.get(out.as_uri())
    _ready(browser)
    rows = _table(browser)
    assert [r["cells"][2] for r in rows] == [f"What is {g} + {g}? <b>&" for g in (2, 1, 0)]
    browser.find_element(By.CSS_SELECTOR, "#groups tbody tr").click()
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#members tbody tr")) == 3, "the members")
    head = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#members thead th")]
    assert head[:2] == ["member", "text_response"] and "finish_reason" in head
    cells = browser.execute_script("return Array.from(document.querySelectorAll('#members tbody tr'))"
                                   ".map(tr => Array.from(tr.cells).map(td => td.textContent))")
    assert [c[1] for c in cells] == [f"answer {i}: {4 + i}\nbye" for i in range(3)]
    assert [c[head.index("finish_reason")] for c in cells] == ["stop", "length", "stop"]
    assert browser.find_element(By.ID, "group-prompt").text == "prompt: What is 2 + 2? <b>&"


@pytest.mark.timeout(300)
def test_pages_of_a_larger_store_live_and_in_the_file(browser, tmp_path):
    """150 groups: the page shows 100, "Older" the other 50 (server-side paging live, client-side in the file)."""
    from view_helpers import make_store

    store = make_store(tmp_path / "store", 150)
    out = tmp_path / "pages.html"
    assert subprocess.run(CLI + ["view", str(store), "--html", str(out)], capture_output=True,
                          timeout=120).returncode == 0
    want = [r["seq"] for r in _rbpipe_query(store, "select seq from groups order by seq desc")]
    proc = subprocess.Popen(CLI + ["view", str(store), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        url = re.search(r"at (http://127\.0\.0\.1:\d+/)", proc.stdout.readline()).group(1)
        for page in (url, out.as_uri()):
            browser.get(page)
            _ready(browser)
            _wait(browser, lambda d: [int(r["seq"]) for r in _table(d)] == want[:100], "the first 100 groups")
            assert browser.find_element(By.ID, "total").text == "150"
            browser.find_element(By.ID, "next").click()
            _wait(browser, lambda d: [int(r["seq"]) for r in _table(d)] == want[100:], "the other 50")
            assert browser.find_element(By.ID, "next").get_attribute("disabled") is not None
            browser.find_element(By.ID, "prev").click()
            _wait(browser, lambda d: [int(r["seq"]) for r in _table(d)] == want[:100], "back to the first page")
    finally:
        terminate(proc)
        proc.stdout.close()
