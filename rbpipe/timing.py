"""Every timing constant of rbpipe in one place: how long things wait, poll, live and get to finish.

Why one module: a wait in one process is usually paired with a wait or a deadline in another (a heartbeat and a
lease's time to live, a stop's grace and a checkpoint's length, a poll and the event it stands in for), and
these pairs only stay consistent when they can be read side by side. Each module that uses one imports it from
here under the same name (tests may still patch it there).

Examples:
    >>> LEASE_TTL_S / 3 > SUPERVISE_POLL_S  # a heartbeat comes far less often than the supervisor looks
    True
"""

from __future__ import annotations

# -- leases (rbpipe.grouping.leases) -----------------------------------------------------------------------------
#: Seconds a lease lives without a renewal. Workers renew every third of it, so a worker has to miss two
#: heartbeats in a row (a kill, a frozen host) before its claims and work units are handed on
#: (``RBPIPE_LEASE_TTL_S`` overrides it).
LEASE_TTL_S = 6.0

# -- the grouping manager process (rbpipe.grouping.manager) ------------------------------------------------------
#: How often the manager checks that its owner (the launcher, the buffer's creator) still lives.
OWNER_POLL_S = 0.25

# -- the service's coordinator (rbpipe.service.coordinator, rbpipe.service.ray) ----------------------------------
#: Seconds the coordinator reuses the grouping counters it reads on every change (dropped groups move the band).
STATS_CACHE_S = 0.05
#: The same on Ray, where a read asks every shard actor.
RAY_STATS_CACHE_S = 0.25
#: Seconds the Ray coordinator waits for the shards' counters before it goes on with the last ones.
STATS_WAIT_S = 0.05
#: ... when it saves the run's final counters (its close): a shard Ray restarts on a cold worker takes seconds.
CLOSE_STATS_WAIT_S = 20.0
#: Longest a ``take_many`` waits for the band to move: a collector still checks for a stop request this often.
MAX_TAKE_WAIT_S = 0.2
#: Seconds between a Ray shard's batched notices of appends to the coordinator (a unit is done when its samples
#: were handed over: the coordinator learns it this much later).
NOTIFY_S = 0.02
#: Seconds a caller waits for a shard that Ray restarts (it replays its log) before the run fails.
RESTART_WAIT_S = 60.0

# -- workers (workers/) ----------------------------------------------------------------------------------------
#: How long one collector ask waits for prompts to open while the rate limit holds them back (the service
#: answers as soon as the learner moves the band; the collector checks for a stop request in between).
TAKE_WAIT_S = 0.1
#: How often a learner waiting for groups looks at the store again: a check is cheap (one fstat when nothing
#: was committed), and at the limiter's 5 ms a step whose groups came just late lost all 5 ms (figures: docs/DESIGN.md,
#: Figures behind code choices).
WAIT_POLL_S = 0.001
#: The supervisor's look at the service: a finished run is wound down this soon after.
SUPERVISE_POLL_S = 0.1
#: Say where the run waits when the learner makes no step for this long.
STALL_REPORT_S = 60.0
#: A stop's bounded waits (docs/DESIGN.md, "Stopping"): workers get STOP_GRACE_S to finish their step (a second
#: signal skips it), then SIGTERM (the learner abandons its step where safe and checkpoints) and TERM_GRACE_S
#: (a checkpoint of a large model takes seconds to write), then SIGKILL (a third signal skips to it).
STOP_GRACE_S = 15.0
TERM_GRACE_S = 30.0

# -- rbpipe stress (rbpipe.cli.stress) -----------------------------------------------------------------------------
#: How long writers may take to come up (spawn a fresh interpreter, import torch) before the run is called hung;
#: the stall timer only starts once every writer has handed over its first trajectory.
STARTUP_TIMEOUT_S = 120.0
