"""Process liveness, shared by every place that must tell a dead lock holder or writer from a live one."""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable


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


def run_worker(name: str, main: Callable[..., Any], *args: Any, cleanup: Callable[[], None] | None = None) -> None:
    """A worker process's body: Ctrl-C ends it quietly; an exception becomes one line naming the worker
    and the cause (which the launcher's supervisor reports), a traceback, and exit code 1."""
    try:
        main(*args)
    except KeyboardInterrupt:
        pass
    except Exception as err:  # noqa: BLE001 - reported by the supervisor
        print(f"[{name}] failed: {type(err).__name__}: {err}", flush=True)
        traceback.print_exc()
        raise SystemExit(1)
    finally:
        if cleanup is not None:
            cleanup()
