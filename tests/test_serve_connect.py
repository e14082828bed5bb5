"""``rbpipe serve`` and workers that attach to it: ``rbpipe collector|learner --connect``, the coordinator.

The end-to-end test runs what a user would type in four shells: a service with a custom task, two collectors
and a learner; mid-run one collector is SIGKILLed and another joins over loopback TCP with the key in
``RBPIPE_AUTHKEY``, and a stranger with a wrong key is turned away while the run goes on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rbpipe.grouping.leases import LEASES
from rbpipe.service.coordinator import Coordinator
from rbpipe.service.journal import load_state
from rbpipe.trajectory import COLLECTOR_KEY, PROMPT_TOKENS_KEY, RESPONSE_TOKENS_KEY, REWARD_KEY
from tests.test_custom_task_model import stored_rows

CLI = [sys.executable, "-m", "rbpipe.cli"]
# A task unlike the built-in one (copy the first digit): any prompt, and a reward of 0.2 per response token that
# is the digit 7 (learnable within a short run, so the test can see the reward rise).
TASK_FILE = """
import torch

from rbpipe.demo.policy import BOS_ID, DIGIT0_ID, EQUALS_ID


class SevensTask:
    def prompt(self, index):
        gen = torch.Generator().manual_seed(index)
        return torch.cat([torch.tensor([BOS_ID]), torch.randint(0, 10, (2,), generator=gen) + DIGIT0_ID,
                          torch.tensor([EQUALS_ID])])

    def reward(self, prompt, response):
        return 0.2 * int((response == DIGIT0_ID + 7).sum())
"""


def custom_reward(prompt: torch.Tensor, response: torch.Tensor) -> float:
    from rbpipe.demo.policy import DIGIT0_ID

    return 0.2 * int((response == DIGIT0_ID + 7).sum())


BAND = {"samples_per_insert": 1.0, "error_buffer": 2.0, "min_size_to_sample": 1}


# -- the coordinator alone (in-process) ---------------------------------------------------------------------------
def test_units_of_a_prompt_go_to_different_collectors_and_a_late_joiner_takes_open_prompts(tmp_path):
    coord = Coordinator(4, 2, BAND, str(tmp_path))
    a, b, c = LEASES.grant(), LEASES.grant(), LEASES.grant()
    coord.join(a), coord.join(b)
    assert coord.take(a) == {"prompt": 0, "samples": 2}
    assert coord.take(a) == {"prompt": 1, "samples": 2}  # not prompt 0 again: b has no share of it yet
    assert coord.take(b) == {"prompt": 0, "samples": 2}
    assert coord.join(c) == 2
    assert coord.take(c) == {"prompt": 1, "samples": 2}  # the late joiner completes the open prompt first
    coord.close()


def test_several_units_in_one_take_are_of_different_prompts_shared_with_the_other_collector(tmp_path):
    coord = Coordinator(4, 2, {"samples_per_insert": 1.0, "error_buffer": 8.0, "min_size_to_sample": 1},
                        str(tmp_path))
    a, b = LEASES.grant(), LEASES.grant()
    coord.join(a), coord.join(b)
    units = [{"prompt": p, "samples": 2} for p in range(3)]
    assert coord.take_many(a, 3) == units  # one unit of each of 3 prompts, never two of one
    assert coord.take_many(b, 3) == units  # the other halves: every group mixes a and b
    coord.appended_many(a, {0: 2, 1: 2, 2: 2})  # a hands its three units over in one call
    assert load_state(tmp_path / "prompts.json")["todo"] == {"0": 2, "1": 2, "2": 2}
    alone = LEASES.grant()
    LEASES.release(b)
    coord.join(alone)
    LEASES.release(a)
    # alone, a collector takes what b owed, then whole prompts (its two units of one prompt merged)
    assert coord.take_many(alone, 4) == [{"prompt": 0, "samples": 2}, {"prompt": 1, "samples": 2},
                                         {"prompt": 2, "samples": 2}, {"prompt": 3, "samples": 2}]
    assert coord.take_many(alone, 3) == [{"prompt": 3, "samples": 2}, {"prompt": 4, "samples": 4}]
    coord.close()


@pytest.mark.timeout(60)
def test_a_waiting_take_is_answered_when_the_learner_moves_the_band_or_a_stop_is_requested(tmp_path, monkeypatch):
    """A collector held back by the band asks once and is answered the moment the learner's report moves the
    band, not a polling interval later (it then generates the next step's groups with the newest weights, while
    the learner trains); a stop request answers a waiting ask at once, with nothing."""
    import threading

    import rbpipe.service.coordinator as coordinator_module

    monkeypatch.setattr(coordinator_module, "MAX_TAKE_WAIT_S", 60.0)  # only a wake-up ends these waits in time
    coord = Coordinator(2, 2, BAND, str(tmp_path))
    a = LEASES.grant()
    coord.join(a)
    opened: list[dict] = []
    while units := coord.take_many(a, 1):
        opened += units
    assert opened and coord.take_many(a, 1, wait_s=0.05) == []  # the band holds; a short wait ends empty
    result: dict = {}

    def ask() -> None:
        result["units"] = coord.take_many(a, 1, wait_s=60.0)

    waiter = threading.Thread(target=ask)
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive(), "the ask waits while the band holds"
    coord.report_learner(consumed_groups=1)
    waiter.join(timeout=10)
    assert not waiter.is_alive() and result["units"] == [{"prompt": len(opened), "samples": 2}]
    waiter = threading.Thread(target=ask)
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()
    coord.request_stop()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and result["units"] == []
    coord.close()


def test_a_dead_collectors_unfinished_units_are_reissued_and_counted(tmp_path):
    coord = Coordinator(4, 2, BAND, str(tmp_path))
    a, b = LEASES.grant(), LEASES.grant()
    coord.join(a), coord.join(b)
    coord.take(a), coord.take(b)  # prompt 0: a and b, 2 samples each
    coord.appended(0, a)  # a hands one over, then dies
    LEASES.release(a)
    assert coord.take(b) == {"prompt": 0, "samples": 1}  # the one sample a still owed, before any new prompt
    status = coord.status()
    assert status["lost_leases"] == 1 and status["reissued_samples"] == 1
    assert load_state(tmp_path / "prompts.json")["todo"] == {"0": 3}  # b's 2 + the reissued 1
    coord.close()


def test_the_band_holds_new_prompts_back_until_the_learner_resolves_groups(tmp_path):
    coord = Coordinator(2, 2, {"samples_per_insert": 1.0, "error_buffer": 1.0, "min_size_to_sample": 1},
                        str(tmp_path))
    a = LEASES.grant()
    coord.join(a)
    assert [coord.take(a)["prompt"] for _ in range(2)] == [0, 1]  # max_diff 2: two prompts ahead
    assert coord.take(a) is None
    coord.report_learner(consumed_groups=1)
    assert coord.take(a) == {"prompt": 2, "samples": 2}
    coord.close()


def test_rbpipe_run_waits_for_all_its_collectors_before_opening_a_prompt(tmp_path):
    coord = Coordinator(4, 2, BAND, str(tmp_path), expect_collectors=2)
    a, b = LEASES.grant(), LEASES.grant()
    coord.join(a)
    assert coord.take(a) is None
    coord.join(b)
    assert coord.take(a) == {"prompt": 0, "samples": 2}
    coord.close()


def test_a_second_learner_is_refused_while_the_first_lives(tmp_path):
    coord = Coordinator(4, 2, BAND, str(tmp_path))
    first, second = LEASES.grant(), LEASES.grant()
    assert coord.claim_learner(first) is None
    assert "already attached" in coord.claim_learner(second)
    LEASES.release(first)
    assert coord.claim_learner(second) is None
    coord.close()


# -- four shells ----------------------------------------------------------------------------------------------------
def _start(args: list[str], env: dict | None = None, stderr=subprocess.STDOUT) -> subprocess.Popen:
    return subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})


def _kill(proc: subprocess.Popen) -> str:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    out, _ = proc.communicate(timeout=30)
    return out or ""


def _finish(workers, timeout: float = 60) -> None:
    """Attached workers end by themselves once the service asks them to: each with exit code 0."""
    for w in workers:
        out, _ = w.communicate(timeout=timeout)
        assert w.returncode == 0, (out or "")[-2000:]


def _kill_leftovers(procs) -> None:
    for p in procs:
        if p.poll() is None:
            _kill(p)


def _steps(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _wait(cond, timeout: float, what: str, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a process exited early ({p.returncode}): {p.stdout.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _collectors_stored(store: Path) -> set[int]:
    """Collector ids in the committed rows (read as the learner reads them, from another process)."""
    from rbpipe.storage import open_storage

    try:
        storage = open_storage(store)
        ids = storage.get(torch.arange(len(storage))).get(COLLECTOR_KEY) if len(storage) else torch.zeros(0)
    except Exception:  # noqa: BLE001 - the store is still being created
        return set()
    return {int(c) for c in ids.reshape(-1).tolist()}


def _stop(proc: subprocess.Popen, timeout: float = 120) -> str:
    os.kill(proc.pid, signal.SIGTERM)  # what `kill PID` sends: a clean shutdown with a summary
    out, _ = proc.communicate(timeout=timeout)
    return out


@pytest.mark.timeout(420)
def test_serve_with_attached_workers_a_kill_a_late_joiner_over_tcp_and_a_wrong_key(tmp_path):
    task = tmp_path / "my_task.py"
    task.write_text(TASK_FILE)
    spec = f"{task}:SevensTask"
    run_dir = tmp_path / "run"
    serve = _start(["serve", "--no-progress", "--json", "--run-dir", str(run_dir), "--task", spec, "--steps", "5000",
                    "--grpo-size", "4", "--groups-per-step", "2", "--collectors", "2", "--lr", "0.003",
                    "--listen", "127.0.0.1:0"], env={"RBPIPE_LEASE_TTL_S": "2"},  # a killed collector's share
                   stderr=subprocess.DEVNULL)  # --json: stdout holds the summary alone
    # of its prompts goes back to the others after 2 s
    procs = [serve]
    try:
        _wait(lambda: (run_dir / "endpoint.json").exists(), 120, "endpoint.json", [serve])
        endpoint = json.loads((run_dir / "endpoint.json").read_text())
        assert oct((run_dir / "authkey").stat().st_mode & 0o777) == "0o600"
        host, port = endpoint["address"]
        assert host == "127.0.0.1"
        a = _start(["collector", "--connect", str(run_dir), "--task", spec])
        b = _start(["collector", "--connect", str(run_dir)])
        learner = _start(["learner", "--connect", str(run_dir)])
        procs += [a, b, learner]
        _wait(lambda: _steps(run_dir) >= 2, 240, "2 learner steps", procs)

        # a stranger with the wrong key is refused in one line, and so is a collector with another task than
        # the service's; the service keeps serving the others
        wrong = tmp_path / "wrong.key"
        wrong.write_text("00" * 32)
        refused = subprocess.Popen(CLI + ["collector", "--connect", f"{host}:{port}", "--authkey-file", str(wrong)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        keyless = subprocess.Popen(CLI + ["collector", "--connect", f"{host}:{port}"], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True,
                                   env={k: v for k, v in os.environ.items() if k != "RBPIPE_AUTHKEY"})
        other = subprocess.Popen(CLI + ["collector", "--connect", str(run_dir), "--task",
                                        "rbpipe.demo.task:CopyFirstDigitTask"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, refused_err = refused.communicate(timeout=60)
        _, other_err = other.communicate(timeout=60)
        assert refused.returncode == 2 and "refused the key" in refused_err, refused_err
        assert len(refused_err.strip().splitlines()) == 1 and "Traceback" not in refused_err
        assert other.returncode == 2 and "differs from the service's" in other_err, other_err
        _, keyless_err = keyless.communicate(timeout=60)  # HOST:PORT without a key: refused before connecting
        assert keyless.returncode == 2 and len(keyless_err.strip().splitlines()) == 1, keyless_err
        assert "RBPIPE_AUTHKEY" in keyless_err and "Traceback" not in keyless_err, keyless_err

        # one collector dies mid-run; a new one joins over loopback TCP with the key in the environment
        os.killpg(a.pid, signal.SIGKILL)
        a.communicate(timeout=30)
        procs.remove(a)
        key = (run_dir / "authkey").read_text().strip()
        c = _start(["collector", "--connect", f"{host}:{port}"], env={"RBPIPE_AUTHKEY": key})
        procs.append(c)
        _wait(lambda: 2 in _collectors_stored(run_dir / "store") and _steps(run_dir) >= 150, 240,
              "the late collector's groups and 150 learner steps", procs)
        assert serve.poll() is None and learner.poll() is None  # still serving, still training

        summary = json.loads(_stop(serve))
        assert serve.returncode == 0
        _finish((b, c, learner))  # attached workers finish when the service asks them to
    finally:
        _kill_leftovers(procs)
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert summary["status"] == "stopped" and summary["learner_steps"] >= 150
    assert summary["conservation_ok"], summary
    assert summary["collectors"]["lost_leases"] == 1
    assert not (run_dir / "endpoint.json").exists()  # a worker arriving now hears that no service runs

    rows = list(stored_rows(run_dir / "store"))
    assert len(rows) == summary["written"] > 0
    for row in rows:  # every stored reward is the custom task's, recomputed from the stored tokens
        assert float(row.get(REWARD_KEY).sum()) == pytest.approx(
            custom_reward(row.get(PROMPT_TOKENS_KEY), row.get(RESPONSE_TOKENS_KEY)), abs=1e-6)
    out = subprocess.run(CLI + ["inspect", str(run_dir / "store"), "--json", "--limit", "0"], capture_output=True,
                         text=True, timeout=60)
    groups = json.loads(out.stdout)["groups"]
    assert len({g["group_id"] for g in groups}) == len(groups), "a group id was stored twice"
    mixed = [g for g in groups if len(set(g["collectors"])) > 1]
    assert len(mixed) >= len(groups) // 2, "groups must mix collectors"

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in records]
    third = len(rewards) // 3
    assert sum(rewards[-third:]) / third > sum(rewards[:third]) / third, rewards


@pytest.mark.timeout(300)
def test_serve_steps_n_stops_after_the_learners_n_steps_and_writes_the_summary(tmp_path):
    run_dir = tmp_path / "run"
    serve = _start(["serve", "--no-progress", "--run-dir", str(run_dir), "--steps", "3", "--grpo-size", "4",
                    "--groups-per-step", "2", "--collectors", "1"])
    procs = [serve]
    try:
        _wait(lambda: (run_dir / "endpoint.json").exists(), 120, "endpoint.json", [serve])
        procs += [_start(["collector", "--connect", str(run_dir)]), _start(["learner", "--connect", str(run_dir)])]
        out, _ = serve.communicate(timeout=240)
        assert serve.returncode == 0, out[-3000:]
        _finish(procs[1:])
    finally:
        _kill_leftovers(procs)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "done" and summary["learner_steps"] == 3 and summary["conservation_ok"]
    for key in ("produced", "written", "dropped", "unselected", "queued", "groups_written", "reward_first20",
                "reward_last20", "duration_s", "store", "session"):
        assert key in summary, key


@pytest.mark.timeout(60)
def test_connect_to_a_run_dir_without_a_service_is_one_line(tmp_path):
    out = subprocess.run(CLI + ["collector", "--connect", str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "no endpoint.json there" in out.stderr and "Traceback" not in out.stderr


def _serve_one_collector(run_dir: Path) -> subprocess.Popen:
    """``rbpipe serve`` (groups of 4, one collector) for the test's own client, once its endpoint is written."""
    serve = _start(["serve", "--no-progress", "--json", "--run-dir", str(run_dir), "--grpo-size", "4",
                    "--collectors", "1"], stderr=subprocess.DEVNULL)
    try:
        _wait(lambda: (run_dir / "endpoint.json").exists(), 120, "endpoint.json", [serve])
    except BaseException:
        if serve.poll() is None:
            _kill(serve)
        raise
    return serve


@pytest.mark.timeout(300)
def test_a_unit_handed_over_in_one_call_keeps_its_good_trajectories_and_counts_the_bad_one(tmp_path):
    """``client.extend(list)``: a work unit in one hand-over. A bad trajectory in it is rejected (counted, one
    line) while the good ones are handed over; the summary's books balance."""
    import rbpipe
    from rbpipe.errors import BadTrajectoryError
    from rbpipe.trajectory import make_trajectory

    run_dir = tmp_path / "run"
    serve = _serve_one_collector(run_dir)
    try:
        with rbpipe.connect(run_dir) as client:
            unit = client.take()
            assert unit == {"prompt": 0, "samples": 4}
            trajs = [make_trajectory(group_id=0, prompt=torch.tensor([1, 2]), response=torch.tensor([3]),
                                     rollout_log_probs=torch.tensor([-0.5]), reward=reward,
                                     collector_id=client.collector_id, policy_version=0)
                     for reward in (1.0, float("nan"), 0.0, 1.0)]
            with pytest.raises(BadTrajectoryError, match="1 of 4 trajectories rejected.*not finite") as err:
                client.extend(trajs)
            assert err.value.rejected == 1
            client.skip(0, err.value.rejected)
            stats = client.buffer.grouping_transform.get_stats()
            assert stats["queued_trajectories"] == 3  # the three good ones wait for a fourth member
        summary = json.loads(_stop(serve))
    finally:
        if serve.poll() is None:
            _kill(serve)
    assert summary["produced"] == 4 and summary["rejected"] == 1 and summary["queued"] == 3
    assert summary["conservation_ok"], summary


@pytest.mark.timeout(300)
def test_a_collector_whose_lease_expired_unnoticed_rejoins_under_a_new_lease(tmp_path):
    """The service can let a collector's lease lapse before the collector's heartbeat notices (on Ray a shard
    restart held renewals up past the time to live): its next ask is answered "expired", and it must re-join
    under a *new* lease. It re-joined under the stale one, was refused again and died ("the service no longer
    knows this collector's lease")."""
    import rbpipe
    from rbpipe.grouping.manager import call

    run_dir = tmp_path / "run"
    serve = _serve_one_collector(run_dir)
    try:
        with rbpipe.connect(run_dir) as client:
            stale = client.lease
            call(client.coordinator, "release", stale)  # the service forgets it; the heartbeat has not run yet
            assert client.take() == {"prompt": 0, "samples": 4}  # re-joined: the released unit, under a new lease
            assert client.lease != stale
        _stop(serve)
    finally:
        if serve.poll() is None:
            _kill(serve)
