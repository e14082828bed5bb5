"""Statistics over paired seeds: how ``bench/e2e.py`` judges the pipeline against the one-process loop.

Seed ``i`` of one side is paired with seed ``i`` of the other (same task, model and sampling seed), so a seed
that is hard for both cancels out of its ratio. A median of three seeds swings too much to judge a 0.8 line
(issue 36), hence the bootstrap interval over seeds; the bootstrap's own seed is fixed so that the same runs
always print the same interval.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

BOOTSTRAP_SEED = 36  # fixed: the interval is a function of the runs alone
BOOTSTRAP_RESAMPLES = 10_000


def paired_ratios(ours: Sequence[float], base: Sequence[float]) -> list[float]:
    """``ours[i] / base[i]`` per seed (the two sides paired by seed).

    Examples:
        >>> paired_ratios([4.0, 9.0], [8.0, 6.0])
        [0.5, 1.5]
    """
    if len(ours) != len(base):
        raise ValueError(f"paired ratios need one value per seed on each side, got {len(ours)} and {len(base)}")
    if any(not b > 0 for b in base):
        raise ValueError(f"paired ratios need positive baseline values, got {list(base)}")
    return [float(o) / float(b) for o, b in zip(ours, base, strict=True)]


def bootstrap_median_ci(values: Sequence[float], level: float = 0.9, *, resamples: int = BOOTSTRAP_RESAMPLES,
                        seed: int = BOOTSTRAP_SEED) -> list[float]:
    """``[low, high]``: the percentile bootstrap interval of the median of ``values`` (resampled with
    replacement, ``resamples`` times, from a generator seeded with ``seed``). One value gives ``[v, v]``.

    Examples:
        >>> bootstrap_median_ci([1.0, 1.0, 1.0])
        [1.0, 1.0]
    """
    if not values:
        raise ValueError("a bootstrap interval needs at least one value")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    data = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    medians = np.median(data[rng.integers(0, len(data), size=(resamples, len(data)))], axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(medians, [tail, 1 - tail])
    return [float(low), float(high)]


def coefficient_of_variation(values: Sequence[float]) -> float | None:
    """Sample standard deviation over mean; ``None`` for fewer than two values (no spread to speak of).

    Examples:
        >>> coefficient_of_variation([90, 100, 110])
        0.1
    """
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    if mean == 0:
        raise ValueError("the coefficient of variation of values whose mean is 0 is undefined")
    return statistics.stdev(values) / abs(mean)


def median_or_none(values: Sequence[float | None]) -> float | None:
    """The median of the values that are known (not ``None``, not NaN); ``None`` if none is.

    Examples:
        >>> median_or_none([None, 3.0, float("nan"), 1.0])
        2.0
    """
    known = [float(v) for v in values if v is not None and not math.isnan(v)]
    return statistics.median(known) if known else None
