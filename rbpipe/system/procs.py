"""Process liveness, shared by every place that must tell a dead lock holder or writer from a live one, and
the per-process files in shared memory that a killed process leaves behind."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import multiprocess
import multiprocess.context

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs on this host; a zombie (killed, not yet reaped) counts as dead."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), or None if unknown: with
    the pid it names one process, so a recycled pid is not mistaken for the process recorded earlier."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def same_process_alive(pid: int, started: int | None) -> bool:
    """True while the process recorded as ``(pid, started)`` still runs (not a later process with its pid)."""
    if not pid_alive(pid):
        return False
    now = start_time(pid)
    return started is None or now is None or now == started


def die_with_parent(parent_pid: int | None, *, poll_s: float = 0.5, deathsig: bool = True,
                    on_exit: Callable[[], None] | None = None) -> None:
    """Make this worker die when ``parent_pid`` (its launcher) dies, however the launcher ends (SIGKILL
    included), so that no orphan keeps writing a store whose lock names a dead process.

    Linux: ``PR_SET_PDEATHSIG`` (SIGKILL, delivered by the kernel when the process that forked this one ends:
    for a worker, the fork server, which exits as soon as the launcher that started it is gone;
    ``deathsig=False`` skips it for a process whose parent may start it from a thread that ends first, as the
    signal follows the starting *thread*). Everywhere, and for the race where the launcher died before the
    call: a daemon thread that polls the launcher (its pid and start time), runs ``on_exit`` (clean-up that
    must not be skipped) and kills this process.
    """
    if parent_pid is None:
        return
    if deathsig:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # not Linux: the watchdog below is enough
    started = start_time(parent_pid)

    def watch() -> None:  # also covers a launcher already gone before the first check
        while same_process_alive(parent_pid, started):
            time.sleep(poll_s)
        if on_exit is not None:
            on_exit()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="rbpipe-parent-watchdog", daemon=True).start()


def shared_memory_dir() -> str | None:
    """``/dev/shm`` when it is a writable directory (RAM-backed: creating a file there is much cheaper than on
    ext4, which allocates and journals an inode; figures: docs/DESIGN.md, Figures behind code choices), else None."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def sweep_dead_files(directory: str | os.PathLike[str], prefix: str) -> int:
    """Unlink ``<prefix><pid>-*`` files of processes that are gone (a SIGKILLed owner never removes its own
    shared-memory files, and /dev/shm is RAM); returns how many."""
    n = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for e in entries:
        if not e.name.startswith(prefix) or not e.is_file(follow_symlinks=False):
            continue
        try:
            pid = int(e.name[len(prefix):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not pid_alive(pid):
            try:
                os.unlink(e.path)
                n += 1
            except OSError:
                pass
    return n


#: Prefix of the temporary directories that hold rbpipe processes' listening Unix sockets (the manager's, the
#: fork server's): ``multiprocess`` would make them ``pymp-*``, which stay in /tmp when their process is SIGKILLed.
#: Short: a socket's path must stay under 108 bytes.
SOCKET_DIR_PREFIX = "rbpipe-sock-"
_SOCKET_DIR_OWNER = ".owner"
_OWNED_SOCKET_DIRS: dict[str, int] = {}  # this process's socket directory -> the fd holding its owner lock


def _new_socket_dir(prefix: str = SOCKET_DIR_PREFIX) -> str:
    """A temporary directory whose ``.owner`` file this process keeps ``flock``-ed for its life. A lock, not a
    PID, says whether its owner lives: the kernel releases it however the process ends, and a process in
    another PID namespace sharing /tmp holds it just the same."""
    import tempfile

    from rbpipe.system.owner_lock import create_held

    for _ in range(16):
        path = tempfile.mkdtemp(prefix=prefix)
        fd = create_held(os.path.join(path, _SOCKET_DIR_OWNER))  # None: swept before or while it was locked
        if fd is not None and os.path.isdir(path):
            _OWNED_SOCKET_DIRS[path] = fd
            return path
        if fd is not None:
            os.close(fd)
    raise OSError("could not create a temporary directory for this process's sockets")


def use_owned_socket_dir(replace: bool = False) -> str:
    """Point this process's ``multiprocess`` temporary directory (where its listening sockets go) at one that
    :func:`sweep_orphaned_socket_dirs` removes once this process is gone, and that a normal exit removes.
    Without ``replace``, a directory already chosen (by ``multiprocess`` or the caller) is kept: its sockets may
    be in use. Returns the directory."""
    import shutil

    from multiprocess import util

    config = multiprocess.current_process()._config
    current = config.get("tempdir")
    if current and not replace:
        return current
    path = _new_socket_dir()
    config["tempdir"] = path
    util.Finalize(None, shutil.rmtree, args=(path, True), exitpriority=-100)  # as multiprocess does for its own
    return path


def owned_temp_dir(prefix: str) -> str:
    """A temporary directory (``<prefix>*``) that :func:`sweep_orphaned_socket_dirs` with that ``prefix`` removes
    once this process is gone; :func:`release_owned_dir` removes it sooner."""
    return _new_socket_dir(prefix)


def release_owned_dir(path: str | os.PathLike[str], remove: bool = True) -> None:
    """Remove an :func:`owned_temp_dir` (``remove=False``: keep it for good, e.g. for inspection: no sweep takes a
    directory without its ``.owner``) and drop its lock."""
    import shutil

    fd = _OWNED_SOCKET_DIRS.pop(str(path), None)
    if remove:
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(path, _SOCKET_DIR_OWNER))
    if fd is not None:
        os.close(fd)


def sweep_orphaned_socket_dirs(root: str | os.PathLike[str] | None = None, prefix: str = SOCKET_DIR_PREFIX) -> int:
    """Remove the socket directories (:func:`use_owned_socket_dir`; ``prefix``: other :func:`owned_temp_dir`
    ones) in ``root`` (the temporary directory) whose owner lock is free: their process is gone (a SIGKILL skips
    every clean-up). Returns how many."""
    import shutil
    import tempfile

    from rbpipe.system.owner_lock import NO_LOCK_FILE, take_if_free

    n = 0
    try:
        entries = list(os.scandir(root or tempfile.gettempdir()))
    except OSError:
        return 0
    for e in entries:
        if not e.name.startswith(prefix) or e.path in _OWNED_SOCKET_DIRS \
                or not e.is_dir(follow_symlinks=False):
            continue
        try:
            fd = take_if_free(os.path.join(e.path, _SOCKET_DIR_OWNER))
        except OSError:  # another user's
            continue
        if fd is None or fd == NO_LOCK_FILE:  # its owner lives, or it is being created (no lock yet)
            continue
        try:
            shutil.rmtree(e.path, ignore_errors=True)
            n += 1
        finally:
            os.close(fd)
    return n


#: ``-W`` filter for the stdlib resource tracker of a worker. torchrl's ``Storage.__init__`` makes two stdlib
#: ``mp.Value``s (named semaphores) in every process that opens a storage; that process's own tracker unlinks
#: them when the process is SIGKILLed, which is the right clean-up, then warns "There appear to be N leaked
#: semaphore objects". Only that tracker's warning is silenced (a tracker inherits its worker's filters).
TRACKER_WARNING_FILTER = "ignore:resource_tracker:UserWarning"


@contextlib.contextmanager
def quiet_killed_worker_trackers() -> Iterator[None]:
    """While starting workers (which inherit the environment), add :data:`TRACKER_WARNING_FILTER` to
    ``PYTHONWARNINGS``; this process's own warnings are untouched."""
    old = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [old, TRACKER_WARNING_FILTER]))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = old


@contextlib.contextmanager
def _signals_ignored(*signums: int) -> Iterator[None]:
    """Ignore ``signums`` (default SIGINT) while starting a process, which inherits the disposition."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal dispositions can only be changed there; a library caller in a thread keeps its own
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signums or (signal.SIGINT,))}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _signals_blocked(*signums: int) -> Iterator[None]:
    """Hold ``signums`` pending (delivered when the block ends) while this thread starts a process."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signums)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


#: What the fork server imports once, so that every worker (and the grouping manager) starts as a fork of an
#: interpreter that has them: importing torch, torchrl and transformers costs seconds of CPU per process, and
#: a run's children importing them at once on 2 cores waited far longer before any did work (figures: docs/DESIGN.md,
#: Figures behind code choices).
WORKER_PRELOAD = ("rbpipe.workers.learner", "rbpipe.workers.collector", "rbpipe.grouping.manager",
                  "rbpipe.demo.policy", "transformers.models.qwen2.modeling_qwen2")


class _WorkerProcess(multiprocess.context.ForkServerProcess):
    """A worker forked by the fork server: a clean interpreter (the server only imported
    :data:`WORKER_PRELOAD`, it never ran a tensor op, so no OpenMP pool is copied), that ignores SIGINT and
    sees the environment its starter had when it called :meth:`start` (as a spawned process would).

    SIGINT: a terminal's Ctrl-C goes to the whole foreground process group; the launcher stops its children
    itself (stop flag, then terminate), so a worker ignores it. The fork server is started with SIGINT ignored
    (:func:`warm_worker_server`), and its children inherit that disposition from their first instruction on.
    """

    def start(self) -> None:
        self._start_environ = dict(os.environ)  # travels with the pickled process object
        # Blocked, not ignored: the fork server makes the child (which inherits the server's SIG_IGN), so this
        # process's disposition does not matter to it, while the first start waits seconds for the server's
        # imports; a Ctrl-C ignored there was lost (a double Ctrl-C during start-up did not stop the run)
        with _signals_blocked(signal.SIGINT):
            super().start()

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # also where the server was started without the guard
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server ignores it (warm_worker_server); a worker stops
        os.environ.clear()  # the server's environment is its own starter's, captured once
        os.environ.update(self._start_environ)
        super().run()


class _WorkerContext(multiprocess.context.ForkServerContext):
    Process = _WorkerProcess


def warm_worker_server() -> None:
    """Start the fork server now (it imports :data:`WORKER_PRELOAD` in the background, on the other core, while
    this process goes on); the first worker start waits for it. Idempotent; the server exits with this
    process."""
    from multiprocess import forkserver

    forkserver.set_forkserver_preload(list(WORKER_PRELOAD))
    sweep_orphaned_socket_dirs()  # those of SIGKILLed launchers and managers
    use_owned_socket_dir()  # the fork server's socket goes there
    # SIGTERM too: `timeout`, `kill -- -PGID` or a service manager send it to the whole process group, and a
    # server that died of it took every worker with it (PR_SET_PDEATHSIG), before the launcher could stop them
    with _signals_ignored(signal.SIGINT, signal.SIGTERM), quiet_killed_worker_trackers():
        forkserver.ensure_running()


#: Why a process rbpipe starts can fail before it runs: the script that started it has no ``__main__`` guard
MAIN_GUARD_HINT = ("a script that starts rbpipe processes (a run, a grouping manager, a shared buffer) must do so "
                   "under `if __name__ == \"__main__\":`: each process it starts imports the script again")


def refuse_start_while_bootstrapping() -> None:
    """In a child that is importing its starter's main script (one without a ``__main__`` guard, which starts
    rbpipe processes again at import time): end with one line, instead of ``multiprocess``'s page-long
    ``RuntimeError`` here and a bare ``EOFError`` in the starter."""
    if getattr(multiprocess.current_process(), "_inheriting", False):
        import sys

        # printed here: a fork server's child ends with os._exit, which would drop a SystemExit's message
        print(f"rbpipe: error: {MAIN_GUARD_HINT}", file=sys.stderr, flush=True)
        raise SystemExit(1)


def worker_context() -> multiprocess.context.BaseContext:
    """The context every rbpipe process is started from: the fork server (:class:`_WorkerProcess`)."""
    refuse_start_while_bootstrapping()
    warm_worker_server()
    return _WorkerContext()


def _parent_pid() -> int | None:
    """The pid of the process that started this ``multiprocess`` child (None in a process started otherwise)."""
    import multiprocess

    parent = multiprocess.parent_process()
    return parent.pid if parent is not None else None


#: Allocations between young-generation collections (Python's default is 700): a learner step allocates
#: a few thousand tracked objects, nearly all freed by reference counting before a collection would see them
GC_YOUNG_THRESHOLD = 10_000


def settle_heap() -> None:
    """End of a worker's start-up: keep what start-up built (modules, the model, compiled kernels) out of
    every later garbage collection (``gc.freeze``; without a collection first, which walks that heap too,
    and what it would free is start-up's few garbage objects), and collect the young generation less often.
    A full collection otherwise walks that whole heap, stalling the step it lands in (in a collector or the
    manager: the learner, waiting for its groups); freezing, then the threshold, cut the learner's time in
    collections to a small fraction (figures: docs/DESIGN.md, Figures behind code choices)."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def run_worker(name: str, main: Callable[..., Any], *args: Any, cleanup: Callable[[], None] | None = None) -> None:
    """A worker process's body: it dies with its launcher (:func:`die_with_parent`); Ctrl-C ends it quietly; an
    exception becomes one line naming the worker and the cause (which the launcher's supervisor reports), a
    traceback, and exit code 1."""
    die_with_parent(_parent_pid())
    try:
        main(*args)
    except KeyboardInterrupt:
        pass
    except Exception as err:  # noqa: BLE001 - reported by the supervisor
        print(f"[{name}] failed: {type(err).__name__}: {err}", flush=True)
        traceback.print_exc()
        raise SystemExit(1) from err
    finally:
        if cleanup is not None:
            cleanup()
