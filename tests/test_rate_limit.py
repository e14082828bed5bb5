"""The rate limiter between collectors and the learner: band arithmetic, refused deadlocks, cross-process use."""

from __future__ import annotations

import json
import multiprocessing
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rbpipe.config import RunConfig
from rbpipe.errors import ConfigError
from rbpipe.rate_limit import RateLimiter
from tests.process_helpers import run_to_summary


@pytest.fixture
def limiter_path(tmp_path):
    return tmp_path / "rate.bin"


def test_defaults_reproduce_the_old_lead_rule(limiter_path):
    """spi 1, min size = groups_per_step: a collector at prompt i may start it iff i - resolved <= lead."""
    cfg = RunConfig(groups_per_step=4, max_policy_lag=3)  # lead = 4 * 2 = 8
    rl = RateLimiter.for_run(cfg, limiter_path, create=True)
    for index in range(20):
        rl.set_inserted(0, index)
        for resolved in range(20):
            rl.set_samples(0, resolved)
            assert rl.can_insert(1, writer=0) == (index - resolved <= cfg.lead_groups)
    rl.set_samples(0, 0)
    rl.set_inserted(0, 9)
    assert not rl.can_sample(4, available=3) and rl.can_sample(4, available=4)


@pytest.mark.parametrize("kwargs, words", [
    (dict(samples_per_insert=0.0, error_buffer=4, min_size_to_sample=2), "samples_per_insert must be > 0"),
    (dict(samples_per_insert=2.0, error_buffer=4, min_size_to_sample=2), "trained once"),
    (dict(samples_per_insert=1.0, error_buffer=-1, min_size_to_sample=4), "min_size_to_sample"),
    (dict(samples_per_insert=1.0, error_buffer=1, min_size_to_sample=2, groups_per_step=4), "one learner step"),
    (dict(samples_per_insert=1.0, error_buffer=1, min_size_to_sample=0), "at least 1"),
])
def test_deadlocking_settings_are_refused_in_one_line(kwargs, words):
    with pytest.raises(ConfigError, match=words) as err:
        RateLimiter(**kwargs)
    assert "\n" not in str(err.value) and "deadlock" in str(err.value)


def test_run_config_refuses_a_min_size_the_lead_never_reaches():
    with pytest.raises(ConfigError, match="deadlock"):
        RunConfig(groups_per_step=2, max_lead_groups=3, min_groups_to_sample=6)
    with pytest.raises(ConfigError, match="deadlock"):
        RunConfig(samples_per_insert=1.5)
    RunConfig(groups_per_step=2, max_lead_groups=5, min_groups_to_sample=6)  # exactly reachable


@settings(max_examples=200, deadline=None)
@given(spi=st.sampled_from([1.0, 0.75, 0.5, 0.3, 0.1]), eb=st.floats(0, 20), min_size=st.integers(1, 10),
       step=st.integers(1, 10), writers=st.integers(1, 3), seed=st.randoms(use_true_random=False))
def test_accepted_settings_never_deadlock_nor_leave_the_band(spi, eb, min_size, step, writers, seed):
    """Writers each contribute to every group (like collectors' shares of one prompt); a group is complete once
    every writer inserted it. Whatever order they move in, someone can always move, and no writer passes the
    band's upper edge."""
    try:
        rl = RateLimiter(samples_per_insert=spi, error_buffer=eb, min_size_to_sample=min_size,
                         groups_per_step=step, writers=writers)
    except ConfigError:
        return
    try:
        inserted, samples = [0] * writers, 0
        for _ in range(300):
            complete = min(inserted) - samples
            movers = [w for w in range(writers) if rl.can_insert(1, writer=w)]
            learner = rl.can_sample(step, available=complete)
            assert movers or learner, f"deadlock at inserted={inserted}, samples={samples}"
            if learner and (not movers or seed.random() < 0.4):
                samples += step
                rl.set_samples(0, samples)
            else:
                w = seed.choice(movers)
                inserted[w] += 1
                rl.set_inserted(w, inserted[w])
                assert inserted[w] * spi - samples <= rl.max_diff + 1e-9
    finally:
        rl.unlink()


def test_wait_honours_timeout_and_stop_event_and_counts_blocked_time(limiter_path):
    rl = RateLimiter(samples_per_insert=1.0, error_buffer=0, min_size_to_sample=2, groups_per_step=2,
                     path=limiter_path, create=True)
    rl.set_inserted(0, 2)
    t0 = time.perf_counter()
    assert rl.wait_insert(1, writer=0, timeout=0.1) is False
    assert time.perf_counter() - t0 >= 0.1
    assert rl.insert_blocked_s() >= 0.1
    stop = multiprocessing.get_context("spawn").Event()
    stop.set()
    assert rl.wait_sample(2, available=lambda: 0, stop_event=stop) is False
    assert rl.wait_sample(2, available=lambda: 2, timeout=0.01) is True


def test_a_wait_checks_as_often_as_its_own_poll_interval_says(limiter_path):
    """The learner looks for its groups every millisecond, whatever the limiter's default interval."""
    rl = RateLimiter(samples_per_insert=1.0, error_buffer=0, min_size_to_sample=2, groups_per_step=2,
                     path=limiter_path, create=True, poll_s=0.05)
    checks = {"default": 0, "own": 0}

    def never(name):
        checks[name] += 1
        return 0

    assert rl.wait_sample(2, available=lambda: never("default"), timeout=0.2) is False
    assert rl.wait_sample(2, available=lambda: never("own"), poll_s=0.001, timeout=0.2) is False
    assert checks["default"] <= 6 and checks["own"] >= 3 * checks["default"]


def _inserter(limiter: RateLimiter, total: int) -> None:
    for i in range(total):
        assert limiter.wait_insert(1, writer=0, timeout=30)
        limiter.set_inserted(0, i + 1)


@pytest.mark.timeout(60)
def test_a_spawned_writer_and_this_sampler_share_one_limiter(limiter_path):
    rl = RateLimiter(samples_per_insert=1.0, error_buffer=2, min_size_to_sample=2, groups_per_step=2,
                     path=limiter_path, create=True)
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_inserter, args=(rl, 20), daemon=True)
    child.start()
    try:
        samples, max_ahead = 0, 0
        while samples < 20:
            assert rl.wait_sample(2, available=lambda s=samples: rl.inserted(0) - s, timeout=30)
            max_ahead = max(max_ahead, rl.inserted(0) - samples)
            samples += 2
            rl.set_samples(0, samples)
        child.join(timeout=30)
        assert child.exitcode == 0
        assert max_ahead <= rl.max_diff  # the writer never ran past the band
        assert rl.insert_blocked_s() > 0  # it had to wait for this sampler at least once
    finally:
        if child.is_alive():
            child.kill()
            child.join()


@pytest.mark.timeout(300)
def test_a_tiny_run_completes_within_the_band_and_logs_the_waits(tmp_path):
    run_dir = tmp_path / "run"
    summary = run_to_summary(run_dir, "--steps", "3", "--collectors", "1", "--groups-per-step", "2", "--grpo-size", "4",
                             "--max-lead-groups", "2", "--min-groups-to-sample", "2")
    assert summary["learner_steps"] == 3
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resolved_before = 0
    for r in records:
        assert r["learner/data_wait_s"] >= 0 and r["learner/collectors_rate_limited_s"] >= 0
        # a collector starts prompt i only while i - resolved <= lead (2): nothing trained lies further ahead
        assert max(gid for gid, _, _ in r["trained_groups"]) <= resolved_before + 2
        resolved_before = r["groups_consumed"] + r["stale_groups"]
    assert not (run_dir / "rate_limit.bin").exists()  # the launcher removes the shared state at the end


def test_the_constructor_example_runs():
    import doctest

    import rbpipe.rate_limit

    result = doctest.testmod(rbpipe.rate_limit)
    assert result.attempted > 0 and result.failed == 0
