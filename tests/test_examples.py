"""Every script in ``examples/`` runs as its docstring says: a custom task, a custom collector loop attached to
``rbpipe serve`` beside rbpipe's own learner, and a learner-only process on the store that run left."""

from __future__ import annotations

import doctest
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_serve_connect import CLI, _finish, _kill_leftovers, _start, _wait

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _python(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=timeout)


def test_the_custom_task_example_prints_its_rewards_and_its_doctest_passes():
    out = _python("custom_task.py")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "reward(right)=1.0" in out.stdout and "reward(wrong)=0.0" in out.stdout
    spec = importlib.util.spec_from_file_location("custom_task_example", EXAMPLES / "custom_task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.timeout(300)
def test_a_custom_collector_loop_and_a_learner_only_process_run_as_documented(tmp_path):
    run_dir = tmp_path / "shared"
    serve = _start(["serve", "--run-dir", str(run_dir), "--steps", "8", "--groups-per-step", "2"])
    procs = [serve]
    try:
        _wait(lambda: (run_dir / "endpoint.json").exists(), 120, "the service's endpoint.json", [serve])
        mine = subprocess.Popen([sys.executable, str(EXAMPLES / "custom_collector.py"), str(run_dir)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        theirs = _start(["collector", "--connect", str(run_dir)])
        learner = _start(["learner", "--connect", str(run_dir)])
        procs += [mine, theirs, learner]
        out, _ = serve.communicate(timeout=240)  # the service stops once the learner made its 8 steps
        assert serve.returncode == 0, out[-3000:]
        _finish((mine, theirs, learner))
    finally:
        _kill_leftovers(procs)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner_steps"] == 8 and summary["conservation_ok"], summary
    assert summary["written"] > 0

    out = _python("learner_only.py", str(run_dir / "store"), "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step 1:" in out.stdout and "step 2:" in out.stdout, out.stdout
    out = subprocess.run(CLI + ["query", str(run_dir / "store"), "select count(*) as n from trajectories", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout)["rows"] == [{"n": summary["written"]}]
