"""Ownership by lease, not by PID: a completed group (a claim) belongs to its writer's lease (a token the
manager keeps alive while the writer heartbeats), and a staged subdirectory to whoever holds its lock file.
Neither depends on what the writer's PID means in the manager's (or the sweeper's) PID namespace."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rbpipe.grouping import SharedMCAdvantage
from rbpipe.grouping.manager import call
from rbpipe.grouping.registry import encode_tensor
from rbpipe.grouping.staging import Staging, _sweep
from tests.grouping.helpers import MINIMAL_KEYS, child, lease_manager, recover_within, traj, writer_child

UNSHARE = ("unshare", "-Urpf")  # a new user + PID namespace
# a bound for every test: the first one also starts the fork server and a manager (60 s ran out at load 20)
pytestmark = pytest.mark.timeout(300)
TTL = 1.5  # seconds: the short lease of the manager these tests start (the short_lease_manager fixture)

# after the shared preamble (tests.grouping.helpers.WRITER_CHILD): complete one group, then hold it or leave
_WRITER = """
claims = list(t.process(traj(0, 5, [1.0]))) + list(t.process(traj(1, 5, [0.0])))
assert len(claims) == 1, claims
if args["mode"] == "close":
    t.close()
print(json.dumps({"pid": os.getpid(), "claim": claims[0].commit_id, "lease": t.lease_token()}), flush=True)
if args["mode"] != "exit":
    time.sleep(600)
"""

_STAGER = textwrap.dedent("""
    import json, os, sys, time
    from rbpipe.grouping.staging import Staging
    from tests.grouping.helpers import traj
    s = Staging(sys.argv[1])
    handles = [s.put(traj(i, 0, [1.0])) for i in range(3)]
    s.delete(handles[:2])  # two recycled files, one payload pending
    print(json.dumps({"pid": os.getpid(), "dir": os.path.dirname(handles[2])}), flush=True)
    time.sleep(600)
""")


def _has_pid_namespaces() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        out = subprocess.run([*UNSHARE, "sh", "-c", "echo $$"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and out.stdout.strip() == "1"


def _spawn(script: str, arg: str, namespace: bool = False) -> tuple[subprocess.Popen, dict]:
    return _started(child([*(UNSHARE if namespace else ()), sys.executable, "-c", script, arg]))


def _started(proc: subprocess.Popen) -> tuple[subprocess.Popen, dict]:
    """The child and the JSON line it prints once it is ready."""
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise AssertionError(f"child failed (exit code {proc.returncode})")
    return proc, json.loads(line)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)
    if proc.stdout is not None:
        proc.stdout.close()


def _writer(manager, t: SharedMCAdvantage, mode: str, namespace: bool = False):
    # in a new user + PID namespace the writer is PID 1, a PID meaningless here
    return _started(writer_child(manager, t, _WRITER, prefix=UNSHARE if namespace else (), mode=mode))


def _transform(manager, tmp_path, name: str = "leases") -> SharedMCAdvantage:
    return SharedMCAdvantage(2, prompt_key="group_id", manager=manager, staging_dir=tmp_path / "staging",
                             name=name, required_keys=MINIMAL_KEYS)


def _append_as(t: SharedMCAdvantage, owner, td) -> dict:
    handle = t.staging.put(td)
    return call(t._registry, "append", t._group_key(td), handle, encode_tensor(td.get(("next", "reward"))), owner,
                False)


def _write_once(t: SharedMCAdvantage, claims: list, commit_id: str) -> None:
    assert [c.commit_id for c in claims] == [commit_id] and claims[0].recovered
    t.confirm(claims[0])
    stats = t.get_stats()
    assert stats["written_groups"] == 1 and stats["queued_trajectories"] == 0
    time.sleep(2 * TTL)
    assert t.recover() == [] and t.recover(force=True) == []  # nobody gets it a second time


HOLD_ATTEMPTS = 4


def _holding_writer(manager, tmp_path, namespace: bool = False):
    """``(t, proc, info)``: a writer (``proc``) that completed a group of ``t`` and held its claim through 2.5
    lease lifetimes, while ``t.recover()`` did not hand that claim on.

    Why attempts, not one sleep: a heartbeat thread starved for a whole lease (a loaded machine) lets the lease
    lapse, and handing the claim on is then right. Such a try proves nothing either way, so the claim's lease is
    checked (renewing a lapsed token fails) and a new writer tries. A live lease whose claim is handed on fails
    at once; a heartbeat that never keeps its lease fails every try."""
    for attempt in range(HOLD_ATTEMPTS):
        t = _transform(manager, tmp_path, f"leases-hold-{attempt}")
        proc, info = _writer(manager, t, "hold", namespace=namespace)
        try:
            time.sleep(2.5 * TTL)  # longer than a lease: only the writer's heartbeat keeps it alive
            claims = t.recover()
            if not claims:
                return t, proc, info
            assert call(t._registry, "renew", info["lease"]) is False, "a claim was handed on while its lease lived"
            t.confirm(claims[0])
        except BaseException:
            _stop(proc)
            raise
        _stop(proc)
    raise AssertionError(f"the writer's lease lapsed in {HOLD_ATTEMPTS} of {HOLD_ATTEMPTS} tries: its heartbeat "
                         "does not keep it alive")


def test_a_live_lease_keeps_its_claim_whatever_its_pid(tmp_path, grouping_manager):
    t = _transform(grouping_manager, tmp_path, "leases-live")
    other = _transform(grouping_manager, tmp_path, "leases-live")
    token = call(t._registry, "lease")  # a writer whose PID means nothing here (another namespace, host)
    assert call(t._registry, "renew", token) is True
    _append_as(t, token, traj(0, 1, [1.0]))
    assert _append_as(t, token, traj(1, 1, [0.0]))["status"] == "write"
    for _ in range(3):
        assert other.recover() == []  # its lease lives: not handed on
        time.sleep(0.2)
    call(t._registry, "release", token)
    assert call(t._registry, "renew", token) is False
    (claim,) = other.recover()  # released: handed on at once
    assert claim.recovered and claim.group == 1
    other.confirm(claim)


def test_an_unknown_owner_counts_as_dead(tmp_path, grouping_manager):
    t = _transform(grouping_manager, tmp_path, "leases-int")
    _append_as(t, os.getpid(), traj(0, 2, [1.0]))  # an int owner (no lease): as a writer that died
    _append_as(t, os.getpid(), traj(1, 2, [0.0]))
    (claim,) = t.recover()
    t.confirm(claim)


def test_a_sigkilled_writers_claim_is_recovered_once_its_lease_expires(tmp_path, short_lease_manager):
    proc = None
    try:
        t, proc, info = _holding_writer(short_lease_manager, tmp_path)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        # handed on once the lease expires: no bound on how soon (that is the machine's speed), only a bound on
        # the wait, far past the lease's time to live
        _write_once(t, recover_within(t, 60), info["claim"])
    finally:
        _stop(proc)


@pytest.mark.parametrize("mode", ["close", "exit"])
def test_a_clean_leave_hands_its_claim_on_at_once(tmp_path, monkeypatch, mode):
    # leases that outlive the test: the claim can only be handed on by the writer's leave, never by its expiry,
    # whatever the machine's speed
    with lease_manager(monkeypatch, 3600) as manager:
        t = _transform(manager, tmp_path, f"leases-{mode}")
        proc = None
        try:
            proc, info = _writer(manager, t, mode)
            if mode == "exit":
                assert proc.wait(30) == 0
            claims = recover_within(t, 60)
            assert [c.commit_id for c in claims] == [info["claim"]]
            t.confirm(claims[0])
        finally:
            _stop(proc)


@pytest.mark.skipif(not _has_pid_namespaces() and not os.environ.get("CI"),
                    reason="needs unshare with user and PID namespaces (CI runs it)")
def test_a_writer_that_is_pid_1_in_its_namespace_keeps_its_claim_and_loses_it_when_killed(
        tmp_path, short_lease_manager):
    proc = None
    try:
        t, proc, info = _holding_writer(short_lease_manager, tmp_path, namespace=True)
        assert info["pid"] == 1
        os.killpg(proc.pid, signal.SIGKILL)  # PID 1 here is alive: a PID check would never hand it on
        proc.wait(30)
        _write_once(t, recover_within(t, 60), info["claim"])
    finally:
        _stop(proc)


def _frees(path: Path) -> int:
    return len(list(path.glob(f"{Staging.FREE}*")))


def test_sweep_keeps_a_live_owners_directory_whatever_pid_it_is_named_after(tmp_path):
    root = tmp_path / "staging"
    Staging(root)
    proc = None
    try:
        proc, info = _spawn(_STAGER, str(root))
        own = root / info["dir"]
        assert _frees(own) == 2
        dead = 4_000_000 + os.getpid()  # above pid_max: no process on this host has it
        foreign = root / f"{dead}-{info['dir'].split('-', 1)[1]}"
        for entry in list(root.iterdir()):  # as a writer in another namespace names it: a PID that means nothing
            if info["dir"] in entry.name:
                entry.rename(entry.with_name(entry.name.replace(info["dir"], foreign.name)))
        assert foreign.is_dir() and _frees(foreign) == 2
        assert _sweep(str(root)) == 0 and _frees(foreign) == 2  # its owner lives: kept
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert _sweep(str(root)) == 2 and _frees(foreign) == 0  # its owner died: recycled files go
        (pending,) = foreign.glob("*.td")  # a pending payload stays for a resume
        pending.unlink()
        _sweep(str(root))
        assert not foreign.exists() and list(root.iterdir()) == []  # and the directory with it
    finally:
        _stop(proc)


@pytest.mark.skipif(not _has_pid_namespaces() and not os.environ.get("CI"),
                    reason="needs unshare with user and PID namespaces (CI runs it)")
def test_sweep_keeps_the_directory_of_a_live_owner_in_another_pid_namespace(tmp_path):
    root = tmp_path / "staging"
    Staging(root)
    proc = None
    try:
        proc, info = _spawn(_STAGER, str(root), namespace=True)
        assert info["pid"] == 1 and info["dir"].startswith("1-")
        assert _sweep(str(root)) == 0 and _frees(root / info["dir"]) == 2
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 60  # the writer inside exits a moment after its unshare parent (a bound)
        while _frees(root / info["dir"]) and time.monotonic() < deadline:
            _sweep(str(root))
            time.sleep(0.05)
        assert _frees(root / info["dir"]) == 0
    finally:
        _stop(proc)


def _heartbeats() -> set:
    import threading

    return {th for th in threading.enumerate() if th.name == "rbpipe-lease-heartbeat"}


def test_a_transform_dropped_without_close_takes_its_heartbeat_and_lease_with_it(tmp_path, grouping_manager):
    import gc

    before = _heartbeats()
    t = _transform(grouping_manager, tmp_path, "leases-dropped")
    registry, token = t._registry, t.lease_token()
    (beat,) = _heartbeats() - before
    del t
    gc.collect()
    beat.join(30)  # it wakes at once (no waiting for its period) and ends
    assert not beat.is_alive(), "the heartbeat of a discarded transform runs for the life of the process"
    assert call(registry, "renew", token) is False  # and its lease was released: its claims go on at once
