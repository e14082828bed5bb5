"""A writer that holds a claim and stops renewing its lease (frozen by SIGSTOP, a stalled host) loses the claim to
the next writer. When it resumes it must not write (or return) the group too, nor fail with a misleading
``StagingError`` because the other writer already deleted the payloads: its late confirmation is refused and it
is told so (``ClaimLostWarning``). The writer freezes itself at the exact point under test (``SIGSTOP`` to its own
pid), so the test never races its speed: it waits for the stop, for the takeover, then resumes it (issue 33)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rbpipe.grouping import SharedMCAdvantage, start_manager
from rbpipe.grouping.manager import manager_address
from tests.grouping.helpers import MINIMAL_KEYS, traj

ROOT = Path(__file__).resolve().parents[2]
TTL = 1.0  # seconds: the short lease of the manager these tests start

_LATE_WRITER = textwrap.dedent("""
    import json, os, signal, sys, warnings
    from rbpipe.grouping import SharedMCAdvantage
    from rbpipe.grouping.manager import connect_manager
    from tests.grouping.helpers import MINIMAL_KEYS, traj
    args = json.loads(sys.argv[1])
    manager = connect_manager(args["address"], bytes.fromhex(args["authkey"]))
    t = SharedMCAdvantage(2, prompt_key="group_id", manager=manager, staging_dir=args["staging"],
                          name=args["name"], required_keys=MINIMAL_KEYS)
    load = SharedMCAdvantage.load

    def frozen_load(self, decision, *rest):  # the freeze, at the point under test
        if args["freeze"] == "before_load":
            os.kill(os.getpid(), signal.SIGSTOP)
        claim = load(self, decision, *rest)
        if args["freeze"] == "after_load":
            os.kill(os.getpid(), signal.SIGSTOP)
        return claim

    SharedMCAdvantage.load = frozen_load
    out = {"returned": None, "error": None, "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            group = t.inv(traj(1, 5, [0.0]))  # completes group 5: this process gets the claim, then freezes
            out["returned"] = None if group is None else sorted(group.get("uid").tolist())
        except Exception as err:
            out["error"] = f"{type(err).__name__}: {err}"
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    print(json.dumps(out), flush=True)
""")


@pytest.fixture
def short_lease_manager(monkeypatch):
    monkeypatch.setenv("RBPIPE_LEASE_TTL_S", str(TTL))
    manager = start_manager()
    try:
        yield manager
    finally:
        manager.shutdown()


def _wait_stopped(pid: int, timeout: float) -> bool:
    """Until the child has stopped itself (an event, not a delay); False if it exited or the time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG | os.WUNTRACED)
        if done and os.WIFSTOPPED(status):
            return True
        if done:
            return False
        time.sleep(0.02)
    return False


def _take_over(t: SharedMCAdvantage, timeout: float) -> list:
    """The frozen writer's claim, once its lease expired (it cannot renew it while stopped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        claims = t.recover()
        if claims:
            return claims
        time.sleep(0.05)
    return []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("freeze", ["before_load", "after_load"])
def test_a_writer_frozen_past_its_lease_does_not_hand_out_the_group_again(tmp_path, short_lease_manager, freeze):
    t = SharedMCAdvantage(2, prompt_key="group_id", manager=short_lease_manager, staging_dir=tmp_path / "staging",
                          name="late", required_keys=MINIMAL_KEYS)
    assert t.inv(traj(0, 5, [1.0])) is None  # the group's first member, staged here
    address, authkey = manager_address(short_lease_manager)
    args = dict(address=address, authkey=authkey.hex(), staging=str(t.staging.path), name="late", freeze=freeze)
    proc = subprocess.Popen([sys.executable, "-c", _LATE_WRITER, json.dumps(args)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, start_new_session=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert _wait_stopped(proc.pid, 90), "the late writer did not reach its freeze point"
        (claim,) = _take_over(t, 30)  # its lease expired while it was stopped: the claim is ours now
        assert claim.recovered and claim.group == 5
        group = t.group_of(claim)
        assert t.confirm(claim) is not False  # written and confirmed here: its payloads are deleted
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert sorted(group.get("uid").tolist()) == [0, 1]
    assert result["error"] is None, result  # not a StagingError about payloads the other writer deleted
    assert result["returned"] is None, f"the group was handed to both writers: {result}"
    assert any(w.startswith("ClaimLostWarning") and "lease expired" in w for w in result["warnings"]), result
    stats = t.get_stats()
    assert (stats["written_groups"], stats["queued_trajectories"]) == (1, 0)
    assert t.staging.handles() == []
    t.close()
