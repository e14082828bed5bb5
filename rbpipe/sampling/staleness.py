"""Learning under staleness (issue 36): which policy versions a group's samples and a learner step's groups carry.

Two options of :class:`~rbpipe.config.RunConfig`, both off by default (``docs/DESIGN.md`` and ``bench/RESULTS.md``
say why):

* ``one_version_per_group``: a prompt's samples are one work unit, so one collector generates the whole group in
  one batch with one weights version, and the group-relative advantage compares samples of one policy. Off, a
  prompt's samples are split among the collectors (``RunConfig.share_of``), which may hold different versions;
  groups then mix collectors and only the shared grouping transform completes them (stock torchrl's
  ``MCAdvantage`` does the same with ``--grouping torchrl``). The grouping itself is unchanged either way: a
  group is still keyed by its prompt. A unit handed back by a collector that died is finished by another, which
  may hold a newer version: the one exception.
* ``sample_order``: ``"oldest"`` trains complete groups in commit order; ``"freshest"`` takes the groups whose
  oldest member has the newest policy version first (commit order among equals). Groups left behind that pass
  ``max_policy_lag`` are retired and counted as stale, like any other; the rate limiter still paces generation
  (a retired group frees its slot in the band as a trained one does), so collectors are held back rather than
  left to generate groups that are then thrown away.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rbpipe.errors import ConfigError

SAMPLE_ORDERS = ("oldest", "freshest")


def check_sample_order(order: str) -> None:
    if order not in SAMPLE_ORDERS:
        raise ConfigError(f"--sample-order must be one of {', '.join(SAMPLE_ORDERS)}, got {order!r}")


def unit_size(cfg: Any) -> int:
    """Samples per work unit: the whole group with ``one_version_per_group``, else one collector's share."""
    return cfg.samples_per_prompt if cfg.one_version_per_group else cfg.share_of(0)


def units_per_ask(cfg: Any) -> int:
    """Work units a collector asks for at once (generated in one batch). A step's prompts split among the
    collectors when each unit is a whole group (each batch as large as with shared prompts); else one unit of
    each of a step's prompts."""
    if cfg.one_version_per_group:
        return max(1, math.ceil(cfg.groups_per_step / cfg.collectors))
    return cfg.groups_per_step


def freshest_first(oldest_versions: torch.Tensor) -> torch.Tensor:
    """The order (indices) that puts the newest of the groups' oldest policy versions first; groups of one version
    keep their commit order (a stable sort), so the older of equals go before they turn stale.

    Examples:
        >>> freshest_first(torch.tensor([3, 5, 3, 5, 4])).tolist()
        [1, 3, 4, 0, 2]
    """
    return torch.sort(oldest_versions, descending=True, stable=True).indices
