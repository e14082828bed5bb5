"""Each process's peak resident memory, for ``summary.json``'s ``peak_rss_mb``.

A real model makes memory the first limit a run meets (a learner's weights, gradients and Adam states alone are
several times the model's size; figures: docs/DESIGN.md, Figures behind code choices), and the peak of a process is gone
with it: so every worker records its own peak (``VmHWM``, the kernel's high-water mark of its resident set) as a small
file under ``RUN_DIR/memory/`` while it runs, and the service reads them when it writes the summary. Workers on other
hosts (Ray) write there too: the run directory is shared. A file is rewritten only when the peak grew by a megabyte or
more, so the learner's per-step check costs one read of ``/proc/self/status``.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

from rbpipe.rundir import MEMORY
from rbpipe.system.fsutil import atomic_write


def peak_rss_mb(pid: int | None = None) -> float | None:
    """The peak resident set of process ``pid`` (default: this one) in MB (10^6 bytes); ``None`` if unknown."""
    try:
        with open(f"/proc/{pid or 'self'}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) * 1024 / 1e6, 1)
    except OSError:
        pass
    if pid is None:  # no /proc: getrusage's maximum (kB on Linux)
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6, 1)
    return None


class PeakMemory:
    """Keeps ``RUN_DIR/memory/<role>-<pid>.json`` at this process's peak: call :meth:`update` now and then (the
    learner after each step, a collector after each batch) and once at the end.

    Examples:
        >>> import tempfile
        >>> run_dir = Path(tempfile.mkdtemp())
        >>> PeakMemory(run_dir, "learner").update() > 0
        True
        >>> sorted(collect(run_dir, since=0))
        ['learner']
    """

    def __init__(self, run_dir: str | Path, role: str, pid: int | None = None) -> None:
        self.role, self.pid = role, pid or os.getpid()
        self.path = Path(run_dir) / MEMORY / f"{role.replace(' ', '-')}-{self.pid}.json"
        self.written = 0.0

    def update(self) -> float:
        """Record the peak if it grew by 1 MB or more since the last record; return it."""
        peak = peak_rss_mb(None if self.pid == os.getpid() else self.pid) or 0.0
        if peak >= self.written + 1.0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            record = {"role": self.role, "pid": self.pid, "peak_rss_mb": peak, "time": time.time()}
            atomic_write(self.path, json.dumps(record), fsync=False)
            self.written = peak
        return peak


def collect(run_dir: str | Path, *, since: float) -> dict[str, float]:
    """``{role: peak MB}`` of the records written since ``since`` (this session's processes); a role whose
    process was restarted gets the largest of its processes' peaks."""
    out: dict[str, float] = {}
    folder = Path(run_dir) / MEMORY
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("time", 0) >= since:
            role = str(record["role"])
            out[role] = max(out.get(role, 0.0), float(record["peak_rss_mb"]))
    return dict(sorted(out.items()))


def record_peak(run_dir: str | Path, role: str, pid: int | None) -> None:
    """Record another process's peak while it still runs (the grouping manager's, read by the service);
    nothing when ``pid`` is unknown (a Ray actor)."""
    if pid is not None:
        PeakMemory(run_dir, role, pid=pid).update()


def session_peaks(run_dir: str | Path, *, since: float) -> dict[str, float]:
    """``summary.json``'s ``peak_rss_mb``: this process's (the service's) peak recorded, then every role's
    since ``since``."""
    PeakMemory(run_dir, "service").update()
    return collect(run_dir, since=since)
