"""Staging leaks and exposure: nothing is left behind by a killed or a cleanly exiting owner, staged payloads
are private and not a code path, and handles from the manager cannot leave the staging directory."""

from __future__ import annotations

import json
import os
import pickle
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import multiprocess
import pytest
import torch
from tensordict import TensorDict

from rbpipe.grouping import SharedMCAdvantage
from rbpipe.grouping.staging import Staging, StagingError, decode_td, encode_td
from rbpipe.system.procs import pid_alive
from tests.grouping.helpers import MINIMAL_KEYS, traj

ROOT = Path(__file__).resolve().parents[2]

_OWNER = textwrap.dedent("""
    import json, sys, time
    from rbpipe.grouping import SharedMCAdvantage
    from tests.grouping.helpers import MINIMAL_KEYS, traj
    if __name__ == "__main__":
        t = SharedMCAdvantage(2, prompt_key="group_id", required_keys=MINIMAL_KEYS)  # its own manager, temp staging
        t.inv(traj(0, 0, [1.0]))  # one payload staged, pending
        address = t._manager.address
        print(json.dumps({"manager": t._manager._process.pid, "address": address, "staging": str(t.staging.path)}),
              flush=True)
        if sys.argv[1] == "wait":
            time.sleep(120)
""")


def _run_owner(tmp_path, mode: str) -> tuple[subprocess.Popen, dict]:
    script = tmp_path / "owner.py"
    script.write_text(_OWNER)
    proc = subprocess.Popen([sys.executable, str(script), mode], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True)
    line = proc.stdout.readline()
    return proc, json.loads(line)


def _gone_within(seconds: float, *checks) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(check() for check in checks):
            return True
        time.sleep(0.1)
    return False


def _kill(pid: int | None) -> None:
    if pid and pid_alive(pid):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(90)
def test_sigkill_of_the_owner_stops_the_manager_and_removes_its_socket_and_staging(tmp_path):
    proc, info = None, {}
    try:
        proc, info = _run_owner(tmp_path, "wait")
        socket_dir = Path(info["address"]).parent if isinstance(info["address"], str) else None
        assert Path(info["staging"]).is_dir() and pid_alive(info["manager"])
        proc.kill()
        proc.wait(10)
        assert _gone_within(10, lambda: pid_alive(info["manager"]), lambda: Path(info["staging"]).exists(),
                            lambda: socket_dir is not None and socket_dir.exists())
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(10)
        _kill(info.get("manager"))


@pytest.mark.timeout(90)
def test_a_clean_exit_without_shutdown_removes_the_temporary_staging(tmp_path):
    proc, info = None, {}
    try:
        proc, info = _run_owner(tmp_path, "exit")
        assert proc.wait(30) == 0
        assert _gone_within(10, lambda: Path(info["staging"]).exists(), lambda: pid_alive(info["manager"]))
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        _kill(info.get("manager"))


def _churn(path: str, handles_out) -> None:
    s = Staging(path)
    handles = [s.put(TensorDict(x=torch.full((2,), float(i)), batch_size=[2])) for i in range(12)]
    s.delete(handles[:8])  # released files kept for reuse
    handles_out.put(handles[8:])


@pytest.mark.timeout(300)
def test_no_released_files_are_left_behind_by_exited_processes(tmp_path):
    ctx = multiprocess.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_churn, args=(str(tmp_path), queue))
    try:
        proc.start()
        pending = queue.get()  # bounded by the test's timeout only (a spawned child's start-up under load)
        proc.join()
        assert proc.exitcode == 0
        assert not list(tmp_path.glob(f"*/{Staging.FREE}*"))  # the child released its own at exit
        s = Staging(tmp_path)
        s.delete(pending)  # renamed into the dead child's directory
        s.release()  # what this process does at exit
        assert not list(tmp_path.glob(f"*/{Staging.FREE}*")) and not list(tmp_path.iterdir())
    finally:
        if proc.is_alive():
            proc.kill()


def test_staging_is_private_to_its_owner(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    for path in (tmp_path / "staging", loose):
        s = Staging(path)
        handle = s.put(TensorDict(x=torch.ones(3), batch_size=[3]))
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path / os.path.dirname(handle)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path / handle).st_mode) == 0o600


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.mark.timeout(60)
def test_a_planted_pickle_is_never_executed_at_resume(tmp_path, grouping_manager):
    staging = tmp_path / "staging"
    marker = tmp_path / "pwned"
    planted = staging / "999999-deadbeef"
    planted.mkdir(parents=True)
    (planted / "0.td").write_bytes(pickle.dumps(_Exploit(str(marker))))
    t = SharedMCAdvantage(2, prompt_key="group_id", manager=grouping_manager, staging_dir=staging,
                          required_keys=MINIMAL_KEYS)
    claims, requeued, torn, _ = t.requeue_staged()
    assert not marker.exists(), "a staged file was unpickled"
    assert (claims, requeued, torn) == ([], 0, 1)


def test_staged_payloads_round_trip_without_pickle():
    td = traj(3, 1, [0.5, 1.0])
    td.set(("nested", "bf"), torch.rand(2, 3).bfloat16())
    data = encode_td(td)
    assert data.startswith(b"RBPS")  # rbpipe's documented format, not a pickle stream
    back = decode_td(data)
    assert back.batch_size == td.batch_size
    for key in td.keys(True, True):
        assert torch.equal(back.get(key), td.get(key)), key
    with pytest.raises(StagingError):
        decode_td(data[:-3])  # a torn payload is refused, never half-read


@pytest.mark.parametrize("handle", ["../outside.td", "/etc/passwd", "1-abcdef12/../../outside.td", "x/0.td",
                                    "1-abcdef12/0.td/..", "quarantine/x.td"])
def test_handles_must_stay_inside_the_staging_directory(tmp_path, handle):
    s = Staging(tmp_path / "staging")
    outside = tmp_path / "outside.td"
    outside.write_bytes(encode_td(TensorDict(x=torch.ones(1), batch_size=[1])))
    with pytest.raises(StagingError, match="handle"):
        s.read(handle)
    with pytest.raises(StagingError, match="handle"):
        s.delete([handle])
    assert outside.exists()
