"""``RateLimiter``: how far collectors may run ahead of the learner, and when the learner may sample.

Modelled on Reverb's ``RateLimiter``/``SampleToInsertRatio``: ``diff = inserts * samples_per_insert -
samples`` must stay at most ``max_diff = samples_per_insert * min_size_to_sample + error_buffer`` for an
insert to go ahead, and the learner samples only once ``min_size_to_sample`` groups are ready. In rbpipe an
*insert* is a prompt a collector starts (every collector contributes its share of every prompt, so each one
counts its own inserts) and a *sample* is a group the pipeline is done with: trained on, retired as stale or
dropped by dynamic sampling. Counting retired groups too keeps the band moving when groups never reach the
learner.

Reverb's band also has a lower edge (``min_diff``) that stops a learner re-sampling items faster than
``samples_per_insert`` allows. rbpipe's learner trains each group once, so it can never sample more than
was inserted; its lower edge is the minimum size itself (plus the ``groups_per_step`` a step needs).

The counts live in a small memory-mapped int64 file, one writing process per slot, so a check costs a few
memory reads (no manager round trip, no lock a killed worker could leave held). The object pickles as its
settings and path, so every spawned process shares the same state.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rbpipe.errors import ConfigError

_EPS = 1e-9
SAMPLE_SOURCES = 2  # slots of resolved groups: 0 learner (trained + stale), 1 launcher (dropped)


def check_settings(samples_per_insert: float, error_buffer: float, min_size_to_sample: int,
                   groups_per_step: int = 1) -> None:
    """Refuse settings under which collectors and learner would end up waiting on each other for good.

    The learner needs ``max(groups_per_step, min_size_to_sample)`` groups ready; collectors stop once they
    are ``max_diff / samples_per_insert`` groups ahead of what was resolved. Each message is one line.
    """
    spi, eb, m, g = samples_per_insert, error_buffer, min_size_to_sample, groups_per_step
    if not spi > 0:
        raise ConfigError(f"rate limit: samples_per_insert must be > 0, got {spi}: collectors would never "
                          "be allowed to insert (deadlock)")
    if spi > 1 + _EPS:
        raise ConfigError(f"rate limit: samples_per_insert {spi} > 1, but each group is trained once, so the "
                          "learner can resolve at most one group per insert and collectors would block for good "
                          "once the band fills (deadlock); use a value in (0, 1]")
    if m < 1 or g < 1:
        raise ConfigError(f"rate limit: min_size_to_sample ({m}) and groups_per_step ({g}) must be at least 1 "
                          "(deadlock: the learner would have nothing to wait for)")
    ahead = math.floor(m + eb / spi + _EPS)  # groups collectors may insert before the band blocks them
    if ahead < g:
        raise ConfigError(f"rate limit: the band lets collectors run only {ahead} group(s) ahead, fewer than the "
                          f"{g} groups of one learner step, so the run would wait forever (deadlock); raise "
                          "--max-lead-groups (error_buffer) or lower --groups-per-step")
    if eb < 0 or ahead < m:
        raise ConfigError(f"rate limit: min_size_to_sample {m} is larger than the {ahead} group(s) collectors may "
                          f"insert before the band blocks them (error_buffer {eb}), so both sides would wait "
                          "forever (deadlock); raise --max-lead-groups or lower --min-groups-to-sample")


class RateLimiter:
    """Shared flow control between writers (collectors) and one sampler (the learner).

    Args:
        samples_per_insert: groups resolved per group inserted, in (0, 1]; 1 trains every group (below 1,
            collectors may out-produce the learner and the surplus turns stale).
        error_buffer: how far (in ``samples_per_insert`` units) inserts may run past the minimum size.
        min_size_to_sample: groups that must be ready before the learner samples.

    Keyword Args:
        groups_per_step: groups one learner step draws (only checked against the band).
        writers: processes that insert, one counter slot each.
        path: the shared state file; None makes a private temporary one (removed by :meth:`unlink`).
        create: start the file from zero (else an existing one is reopened: a worker joining later).
        poll_s: sleep between checks while blocked.

    Raises:
        ConfigError: settings that can never make progress (one line, naming the deadlock).

    Examples:
        >>> rl = RateLimiter(samples_per_insert=1.0, error_buffer=1, min_size_to_sample=2)
        >>> rl.max_diff
        3.0
        >>> rl.set_inserted(0, 3)          # a collector three groups ahead of the learner
        >>> rl.can_insert(1), rl.can_sample(2, available=3)
        (False, True)
        >>> rl.set_samples(0, 2)           # the learner resolved two groups: the band moves on
        >>> rl.can_insert(1)
        True
        >>> rl.unlink()
    """

    def __init__(self, samples_per_insert: float = 1.0, error_buffer: float = 0.0, min_size_to_sample: int = 1,
                 *, groups_per_step: int = 1, writers: int = 1, path: str | os.PathLike | None = None,
                 create: bool = True, poll_s: float = 0.005) -> None:
        check_settings(samples_per_insert, error_buffer, min_size_to_sample, groups_per_step)
        self.samples_per_insert = float(samples_per_insert)
        self.error_buffer = float(error_buffer)
        self.min_size_to_sample = int(min_size_to_sample)
        self.groups_per_step = int(groups_per_step)
        self.writers = int(writers)
        self.poll_s = float(poll_s)
        if path is None:
            fd, path = tempfile.mkstemp(prefix="rbpipe-rate-", suffix=".bin")
            os.close(fd)
            create = True
        self.path = Path(path)
        if create:
            self.path.unlink(missing_ok=True)
        self._open()

    @staticmethod
    def settings_for_run(cfg: Any) -> dict[str, Any]:
        """The band of a :class:`~rbpipe.config.RunConfig`: its defaults reproduce the old lead rule (prompt
        ``i`` starts only while ``i - resolved <= lead_groups``)."""
        spi, m = cfg.samples_per_insert, cfg.min_size_to_sample
        return {"samples_per_insert": spi, "error_buffer": spi * (cfg.lead_groups + 1 - m), "min_size_to_sample": m,
                "groups_per_step": cfg.groups_per_step}

    @classmethod
    def for_run(cls, cfg: Any, path: str | os.PathLike, *, create: bool = True, writers: int = 1) -> RateLimiter:
        """The limiter of a :class:`~rbpipe.config.RunConfig` (a service's coordinator is its one writer)."""
        return cls(**cls.settings_for_run(cfg), writers=writers, path=path, create=create)

    # -- shared state: [inserts per writer | resolved per source | blocked ns per writer | sampler blocked ns]
    def _open(self) -> None:
        size = 2 * self.writers + SAMPLE_SOURCES + 1
        self._a = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.int64)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_a"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    # -- counts ------------------------------------------------------------------------------------------------
    @property
    def max_diff(self) -> float:
        """Upper edge of the band: Reverb's ``samples_per_insert * min_size_to_sample + error_buffer``."""
        return self.samples_per_insert * self.min_size_to_sample + self.error_buffer

    def set_inserted(self, writer: int, count: int) -> None:
        """Groups writer ``writer`` has inserted so far (absolute, so a restarted writer just sets it again)."""
        self._a[writer] = int(count)

    def inserted(self, writer: int) -> int:
        return int(self._a[writer])

    def set_samples(self, source: int, count: int) -> None:
        """Groups resolved so far by ``source`` (0: the learner, trained + stale; 1: the launcher, dropped)."""
        self._a[self.writers + source] = int(count)

    def samples(self) -> int:
        return int(self._a[self.writers:self.writers + SAMPLE_SOURCES].sum())

    def insert_blocked_s(self, writer: int | None = None) -> float:
        """Seconds writers (or one writer) spent waiting on the band."""
        base = self.writers + SAMPLE_SOURCES
        ns = self._a[base:base + self.writers].sum() if writer is None else self._a[base + writer]
        return int(ns) / 1e9

    def set_insert_blocked_ns(self, writer: int, ns: int) -> None:
        """Time writer ``writer`` has spent blocked (a writer that waits elsewhere, e.g. the coordinator)."""
        self._a[self.writers + SAMPLE_SOURCES + writer] = int(ns)

    def sample_blocked_s(self) -> float:
        """Seconds the sampler spent waiting for data."""
        return int(self._a[-1]) / 1e9

    # -- checks ------------------------------------------------------------------------------------------------
    def can_insert(self, n: int = 1, writer: int = 0) -> bool:
        return (self.inserted(writer) + n) * self.samples_per_insert - self.samples() <= self.max_diff + _EPS

    def can_sample(self, n: int, available: int | None = None) -> bool:
        """``available``: groups ready to sample (the learner's fresh groups); by default the groups every
        writer has inserted that are not resolved yet."""
        if available is None:
            available = min(self.inserted(w) for w in range(self.writers)) - self.samples()
        return available >= max(n, self.min_size_to_sample)

    def wait_insert(self, n: int = 1, writer: int = 0, *, stop_event=None, timeout: float | None = None) -> bool:
        """Block until ``n`` inserts fit the band; False on stop or timeout. Blocked time is counted."""
        return self._wait(lambda: self.can_insert(n, writer), self.writers + SAMPLE_SOURCES + writer,
                          stop_event, timeout, None)

    def wait_sample(self, n: int, available: Callable[[], int] | None = None, *, stop_event=None,
                    timeout: float | None = None, on_wait: Callable[[], object] | None = None,
                    poll_s: float | None = None) -> bool:
        """Block until ``n`` groups may be sampled; ``on_wait`` runs between checks (the learner publishes
        the groups it retired as stale meanwhile, which frees the collectors). False on stop or timeout.
        ``poll_s``: this wait's sleep between checks (default: the limiter's)."""
        ready = (lambda: self.can_sample(n, available())) if available is not None else (lambda: self.can_sample(n))
        return self._wait(ready, len(self._a) - 1, stop_event, timeout, on_wait, poll_s)

    def _wait(self, ready: Callable[[], bool], slot: int, stop_event, timeout: float | None,
              on_wait: Callable[[], object] | None = None, poll_s: float | None = None) -> bool:
        if ready():
            return True
        start = last = time.perf_counter_ns()
        deadline = None if timeout is None else start + int(timeout * 1e9)
        while True:
            now = time.perf_counter_ns()
            self._a[slot] += now - last  # counted as it accrues: readers see a wait that has not ended yet
            last = now
            if stop_event is not None and stop_event.is_set():
                return False
            if deadline is not None and now >= deadline:
                return False
            if on_wait is not None:
                on_wait()
            if ready():
                self._a[slot] += time.perf_counter_ns() - last
                return True
            time.sleep(self.poll_s if poll_s is None else poll_s)

    def describe(self) -> str:
        """One line for stall reports: where the band stands."""
        ins = [self.inserted(w) for w in range(self.writers)]
        return (f"rate limit: inserted {ins}, resolved {self.samples()}, band upper edge {self.max_diff:g} "
                f"(samples_per_insert {self.samples_per_insert:g}, min_size_to_sample {self.min_size_to_sample})")
