"""``rbpipe.tracking.seed_stats``: the paired-seed figures ``bench/e2e.py --json`` prints (issue 36)."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rbpipe.tracking.seed_stats import bootstrap_median_ci, coefficient_of_variation, median_or_none, paired_ratios

positive = st.floats(min_value=0.01, max_value=1e4, allow_nan=False, allow_infinity=False)
samples = st.lists(positive, min_size=1, max_size=12)


@given(st.lists(st.tuples(positive, positive), min_size=1, max_size=12), positive)
def test_ratios_pair_seed_i_with_seed_i_and_ignore_a_common_scale(pairs, scale):
    ours, base = [o for o, _ in pairs], [b for _, b in pairs]
    ratios = paired_ratios(ours, base)
    assert ratios == pytest.approx([o / b for o, b in pairs])
    assert paired_ratios([o * scale for o in ours], [b * scale for b in base]) == pytest.approx(ratios)


def test_ratios_refuse_unpaired_or_nonpositive_baselines():
    with pytest.raises(ValueError, match="one value per seed"):
        paired_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        paired_ratios([1.0], [0.0])


@settings(max_examples=40, deadline=None)
@given(samples)
def test_interval_lies_within_the_data_and_is_the_same_every_time(values):
    low, high = bootstrap_median_ci(values)
    assert min(values) - 1e-9 <= low <= high <= max(values) + 1e-9
    assert bootstrap_median_ci(values) == [low, high]  # fixed bootstrap seed: same runs, same interval


@settings(max_examples=30, deadline=None)
@given(samples, st.floats(min_value=0.1, max_value=10))
def test_interval_scales_with_the_data_and_widens_with_the_level(values, scale):
    low, high = bootstrap_median_ci(values, 0.9)
    assert bootstrap_median_ci([v * scale for v in values], 0.9) == pytest.approx([low * scale, high * scale])
    low50, high50 = bootstrap_median_ci(values, 0.5)  # same resamples: a narrower quantile range
    assert low <= low50 + 1e-12 and high50 <= high + 1e-12


def test_interval_of_spread_seeds_holds_their_median():
    ratios = [0.66, 0.68, 0.68, 0.80, 0.80, 0.86, 0.92, 1.04, 1.10, 1.52]  # issue 36's ten seeds
    low, high = bootstrap_median_ci(ratios)
    assert low < statistics.median(ratios) < high
    assert 0.66 <= low <= 0.8 and 0.86 <= high <= 1.10
    assert bootstrap_median_ci([0.8]) == [0.8, 0.8]
    with pytest.raises(ValueError):
        bootstrap_median_ci([])


@given(st.lists(positive, min_size=2, max_size=12), positive)
def test_cv_is_scale_free_and_zero_without_spread(values, scale):
    cv = coefficient_of_variation(values)
    assert cv == pytest.approx(statistics.stdev(values) / statistics.fmean(values))
    assert coefficient_of_variation([v * scale for v in values]) == pytest.approx(cv, abs=1e-9)
    assert coefficient_of_variation([values[0]] * len(values)) == pytest.approx(0.0, abs=1e-9)


def test_cv_of_one_seed_is_unknown_and_median_skips_unknowns():
    assert coefficient_of_variation([250]) is None
    assert median_or_none([None, float("nan")]) is None
    assert median_or_none([0.3, None, 0.1]) == pytest.approx(0.2)


def test_e2e_bench_prints_the_issue_36_fields_from_paired_runs():
    """``bench/e2e.py --json``'s paired figures, spelled as issue 36 names them, from runs made up here."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        from e2e import paired_summary
    finally:
        sys.path.pop(0)
    base = [{"seconds": s, "steps": n, "cpu_s": 2 * s} for s, n in ((10.0, 200), (8.0, 180), (12.0, 240))]
    ours = [{"seconds": s, "steps": n, "cpu_s": 3 * s, "learner_wait": w, "policy_lag": 1.1, "ess": 0.98}
            for s, n, w in ((8.0, 210, 0.05), (8.0, 170, None), (6.0, 250, 0.07))]
    out = paired_summary(base, ours)
    assert out["ratios"] == [0.8, 1.0, 0.5]  # seed i against seed i, not median against median
    assert out["ratio_wall_median"] == 0.8 and out["ratio_cpu_median"] == pytest.approx(1.2)
    low, high = out["ratio_wall_ci90"]
    assert 0.5 <= low <= 0.8 <= high <= 1.0
    assert out["steps_cv"] == pytest.approx(statistics.stdev([210, 170, 250]) / 210)
    assert out["learner_wait"] == pytest.approx(0.06) and out["policy_lag"] == 1.1 and out["ess"] == 0.98
