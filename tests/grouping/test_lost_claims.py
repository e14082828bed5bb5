"""A writer that holds a claim and stops renewing its lease (frozen by SIGSTOP, a stalled host) loses the claim to
the next writer. When it resumes it must not write (or return) the group too, nor fail with a misleading
``StagingError`` because the other writer already deleted the payloads: its late confirmation is refused and it
is told so (``ClaimLostWarning``). The writer freezes itself at the exact point under test (``SIGSTOP`` to its own
pid), so the test never races its speed: it waits for the stop, for the takeover, then resumes it (issue 33)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from rbpipe.grouping import SharedMCAdvantage
from tests.grouping.helpers import MINIMAL_KEYS, recover_within, traj, writer_child
from tests.process_helpers import wait_stopped

# a bound for every test: the first one also starts the fork server and a manager (60 s ran out at load 20)
pytestmark = pytest.mark.timeout(300)
TTL = 1.0  # seconds: the short lease of the manager these tests start (the short_lease_manager fixture)

# after the shared preamble (tests.grouping.helpers.WRITER_CHILD): freeze at the point under test, then report
_LATE_WRITER = """
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
"""


@pytest.mark.parametrize("freeze", ["before_load", "after_load"])
def test_a_writer_frozen_past_its_lease_does_not_hand_out_the_group_again(tmp_path, short_lease_manager, freeze):
    t = SharedMCAdvantage(2, prompt_key="group_id", manager=short_lease_manager, staging_dir=tmp_path / "staging",
                          name="late", required_keys=MINIMAL_KEYS)
    assert t.inv(traj(0, 5, [1.0])) is None  # the group's first member, staged here
    proc = writer_child(short_lease_manager, t, _LATE_WRITER, freeze=freeze)
    try:
        assert wait_stopped(proc.pid, 90), "the late writer did not reach its freeze point"
        (claim,) = recover_within(t, 30)  # its lease expired while it was stopped: the claim is ours now
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
