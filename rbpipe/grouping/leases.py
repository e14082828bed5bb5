"""Leases: who owns a claim or a work unit, in a way that survives hosts, containers and PID namespaces.

A worker takes a lease from the service (a random token with an expiry on the *service's* clock), renews it
while it lives (a heartbeat thread, and every call it makes), and releases it when it leaves. Whatever it owns
(a completed group it must write, a share of a prompt it must generate) is handed to another worker once its
lease is released or has expired. A PID says nothing about a process in another PID namespace or on another
host; a lease only needs the service to keep time.

Examples:
    >>> table = LeaseTable(ttl_s=5.0)
    >>> token = table.grant()
    >>> table.alive(token), table.alive("someone-else")
    (True, False)
    >>> table.release(token)
    >>> table.alive(token)
    False
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import time

from rbpipe.timing import LEASE_TTL_S

#: Environment variable that overrides :data:`LEASE_TTL_S` (read by the manager process when it starts).
TTL_ENV = "RBPIPE_LEASE_TTL_S"


def ttl_from_env(raw: str | None = None) -> float:
    """The lease time to live from ``RBPIPE_LEASE_TTL_S`` (default :data:`LEASE_TTL_S`); a value that is not
    a finite number of seconds > 0 raises ``ValueError`` naming the variable."""
    raw = os.environ.get(TTL_ENV) if raw is None else raw
    if raw is None or raw == "":
        return LEASE_TTL_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{TTL_ENV} must be a number of seconds > 0 (how long a worker's lease lives without "
                         f"a heartbeat), got {raw!r}")
    return value


def _default_ttl() -> float:
    try:
        return ttl_from_env()
    except ValueError:  # refused in plain words by the workers (SharedMCAdvantage); the manager keeps serving
        return LEASE_TTL_S


class LeaseTable:
    """Tokens and their expiry (``time.monotonic`` of the process holding the table). Thread-safe."""

    def __init__(self, ttl_s: float = LEASE_TTL_S, clock=time.monotonic) -> None:
        if not ttl_s > 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl_s}")
        self.ttl_s = float(ttl_s)
        self._clock = clock
        self._expiry: dict[str, float] = {}
        self._lock = threading.Lock()

    def grant(self, ttl_s: float | None = None) -> str:
        """A new live token (``ttl_s``: this lease's time to live, else the table's)."""
        token = "lease-" + secrets.token_hex(12)
        with self._lock:
            self._expiry[token] = self._clock() + (ttl_s or self.ttl_s)
        return token

    def renew(self, token: str) -> bool:
        """Extend a live lease; False when it expired or was released (its holder must take a new one:
        what it owned may already be someone else's)."""
        now = self._clock()
        with self._lock:
            expiry = self._expiry.get(token)
            if expiry is None or expiry <= now:
                self._expiry.pop(token, None)
                return False
            self._expiry[token] = now + self.ttl_s
            return True

    def adopt(self, token: str) -> None:
        """Take in ``token``, granted by another table (a lease authority), as live for one time to live.
        A registry shard of the Ray engine keeps its own table and adopts the coordinator's leases, so that
        checking an owner never leaves the shard."""
        with self._lock:
            self._expiry[token] = self._clock() + self.ttl_s

    def release(self, token: str) -> None:
        """The holder leaves: what it owned is handed on at once."""
        with self._lock:
            self._expiry.pop(token, None)

    def alive(self, token) -> bool:
        """Whether ``token`` is a lease that neither expired nor was released (any other value: False)."""
        expiry = self._expiry.get(token) if isinstance(token, str) else None
        return expiry is not None and expiry > self._clock()

    def live(self) -> list[str]:
        """Every live token (expired ones are forgotten on the way)."""
        now = self._clock()
        with self._lock:
            for token in [t for t, e in self._expiry.items() if e <= now]:
                del self._expiry[token]
            return list(self._expiry)


class LeaseAuthority:
    """The lease calls a service answers for its writers, over one :class:`LeaseTable` (``self._leases``).

    Why a mixin: the local engine's :class:`~rbpipe.grouping.registry.GroupRegistry` (behind the manager) and the
    Ray engine's coordinator actor are both the authority of their service's leases; with one definition a
    writer's heartbeat means the same on both engines.
    """

    _leases: LeaseTable

    def lease(self) -> str:
        """A new lease token for a writer: the owner of what it claims while the lease lives."""
        return self._leases.grant()

    def renew(self, token) -> bool:
        """Keep ``token`` alive (a heartbeat); False when it expired or was released (take a new one)."""
        return self._leases.renew(token) if isinstance(token, str) else False

    def release(self, token) -> None:
        """The writer leaves: what it holds is handed to the next caller at once."""
        if isinstance(token, str):
            self._leases.release(token)

    def lease_ttl(self) -> float:
        """Seconds a lease lives without a renewal (renew at least every third of it)."""
        return self._leases.ttl_s


#: (Manager process.) The one table that registries and coordinators of a service share.
LEASES = LeaseTable(_default_ttl())
