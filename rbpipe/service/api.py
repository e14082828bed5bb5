"""The service coordinator's remote interface: the method names its proxies expose.

In a module of its own (no imports) because three places need it and none may import another for it: the
coordinator (which implements it), the grouping manager (which serves it over ``multiprocess``) and the Ray
engine's coordinator actor (which serves it over Ray).
"""

from __future__ import annotations

#: :class:`rbpipe.service.coordinator.Coordinator`'s remote methods
COORDINATOR_EXPOSED = ("take", "take_many", "skip", "count", "join", "release", "claim_learner", "report_learner",
                       "learner", "status", "endpoint", "set_endpoint", "request_stop", "stop_requested", "timing",
                       "reconcile_staged", "close")
