"""Workers forked by the fork server (``rbpipe.system.procs.worker_context``) behave as spawned ones did: they see
their starter's environment as it was at ``start()``, ignore Ctrl-C, and die when their starter is SIGKILLed
(their direct parent is the fork server, not the starter, so neither ``getppid`` nor the death signal of the
starter alone would tell them)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from rbpipe.system.procs import pid_alive, worker_context


def _report(path: str) -> None:
    disposition = "ignored" if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else "handled"
    Path(path).write_text(f"{os.environ.get('RBPIPE_TEST_MARK', '<unset>')} {disposition} {os.getpid()}")


def _run_report(path: Path) -> list[str]:
    proc = worker_context().Process(target=_report, args=(str(path),), daemon=True)
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0, proc.exitcode
    return path.read_text().split()


@pytest.mark.timeout(120)
def test_a_worker_sees_its_starters_environment_of_the_moment_and_ignores_ctrl_c(tmp_path, monkeypatch):
    monkeypatch.setenv("RBPIPE_TEST_MARK", "first")
    mark, sigint, pid = _run_report(tmp_path / "a")
    assert (mark, sigint) == ("first", "ignored")
    assert int(pid) != os.getpid()
    monkeypatch.setenv("RBPIPE_TEST_MARK", "second")  # the fork server started earlier: a later change counts
    assert _run_report(tmp_path / "b")[:2] == ["second", "ignored"]
    monkeypatch.delenv("RBPIPE_TEST_MARK")
    assert _run_report(tmp_path / "c")[0] == "<unset>"


STARTER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from rbpipe.system.procs import run_worker, worker_context

    def forever(ready):  # run by run_worker once its parent watchdog runs: says so, then runs until killed
        Path(ready).touch()
        while True:
            time.sleep(0.1)

    def body(ready):
        run_worker("test worker", forever, ready)

    if __name__ == "__main__":
        proc = worker_context().Process(target=body, args=(sys.argv[1],), daemon=True)
        proc.start()
        print(proc.pid, flush=True)
        time.sleep(600)
""")


@pytest.mark.timeout(120)
def test_a_worker_dies_when_its_starter_is_sigkilled(tmp_path):
    script = tmp_path / "starter.py"
    script.write_text(STARTER)
    ready = tmp_path / "ready"
    starter = subprocess.Popen([sys.executable, str(script), str(ready)], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    worker = None
    try:
        line = starter.stdout.readline()
        assert line.strip().isdigit(), line
        worker = int(line)
        assert pid_alive(worker)
        deadline = time.time() + 60  # a bound, not a delay: the worker's watchdog is running once it wrote `ready`
        while not ready.exists() and pid_alive(worker) and time.time() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the worker never ran its target"
        starter.kill()
        starter.wait(10)
        deadline = time.time() + 60
        while pid_alive(worker) and time.time() < deadline:
            time.sleep(0.05)
        assert not pid_alive(worker), "the worker outlived its SIGKILLed starter"
    finally:
        try:
            os.killpg(starter.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        starter.wait(10)
        if worker is not None and pid_alive(worker):
            os.kill(worker, signal.SIGKILL)


SOCKETS_STARTER = textwrap.dedent("""
    import json, os, time
    import multiprocess
    from rbpipe.grouping import start_manager

    if __name__ == "__main__":
        manager = start_manager()
        print(json.dumps({"launcher": multiprocess.current_process()._config["tempdir"],
                          "manager": os.path.dirname(manager.address), "manager_pid": manager._process.pid}),
              flush=True)
        time.sleep(600)
""")


@pytest.mark.timeout(120)
def test_socket_directories_of_sigkilled_processes_are_swept_and_live_ones_kept(tmp_path):
    """The launcher's fork server and the manager listen on Unix sockets in temporary directories that only a
    normal exit removes. After a SIGKILL of all of them at once, the next start's sweep removes them; while
    their processes live, a sweep leaves them alone (their owner lock is held)."""
    import json

    from rbpipe.system.procs import SOCKET_DIR_PREFIX, sweep_orphaned_socket_dirs

    script = tmp_path / "starter.py"
    script.write_text(SOCKETS_STARTER)
    # a private temporary directory: every rbpipe run on this machine sweeps /tmp, and one started by somebody
    # else between the kill and the checks below would remove these directories first (short: socket paths)
    root = Path(tempfile.mkdtemp(prefix="rbs-", dir="/tmp"))
    starter = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                               start_new_session=True, env=dict(os.environ, TMPDIR=str(root)))
    try:
        try:
            info = json.loads(starter.stdout.readline())
            dirs = [Path(info["launcher"]), Path(info["manager"])]
            assert all(d.name.startswith(SOCKET_DIR_PREFIX) and d.parent == root and d.is_dir() for d in dirs), info
            assert dirs[0] != dirs[1] and any(dirs[1].glob("listener-*")), info
            sweep_orphaned_socket_dirs(root)
            assert all(d.is_dir() for d in dirs), "a live process's socket directory was swept"
        finally:
            os.killpg(starter.pid, signal.SIGKILL)  # launcher, fork server and manager: nobody cleans up
            starter.wait(10)
        deadline = time.time() + 10
        while pid_alive(info["manager_pid"]) and time.time() < deadline:
            time.sleep(0.05)
        assert all(d.is_dir() for d in dirs)  # left behind by the kill...
        assert sweep_orphaned_socket_dirs(root) == 2
        assert not any(d.exists() for d in dirs)  # ...and removed by the next sweep
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(120)
def test_a_script_without_a_main_guard_is_told_so_in_one_line(tmp_path):
    """Each process rbpipe starts imports its starter's script again; without ``if __name__ == "__main__":`` the
    script starts a manager again in there. Starter and child each end with one line that names the guard (the
    starter used to get a bare ``EOFError``, the child multiprocess's page-long ``RuntimeError``)."""
    script = tmp_path / "no_guard.py"
    script.write_text("from rbpipe.grouping import start_manager\nmanager = start_manager()\nmanager.shutdown()\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100,
                          env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("rbpipe.errors.ConfigError: the grouping manager process ended before it started"), last
    assert 'if __name__ == "__main__":' in last
    assert "EOFError" not in done.stderr and "bootstrapping phase" not in done.stderr, done.stderr[-3000:]
    child = [line for line in done.stderr.splitlines() if line.startswith("rbpipe: error:")]
    assert len(child) == 1 and 'if __name__ == "__main__":' in child[0], done.stderr[-3000:]
