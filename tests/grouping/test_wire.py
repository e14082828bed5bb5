"""The manager wire's poll-before-sleep: configurable, never delays a message, never hides a dead peer."""

from __future__ import annotations

import time

import pytest

from rbpipe.errors import ConfigError, ManagerDiedError
from rbpipe.grouping import start_manager
from rbpipe.grouping.manager import call, open_registry, spin_seconds


def test_spin_window_comes_from_the_environment_in_microseconds(monkeypatch):
    monkeypatch.delenv("RBPIPE_SPIN_US", raising=False)
    assert spin_seconds() == pytest.approx(1e-3)
    assert spin_seconds("0") == 0.0
    assert spin_seconds("250") == pytest.approx(250e-6)
    for bad in ("fast", "-1", "nan"):
        with pytest.raises(ConfigError, match="RBPIPE_SPIN_US must be a number of microseconds"):
            spin_seconds(bad)


@pytest.mark.timeout(60)
def test_a_long_poll_window_neither_delays_answers_nor_hides_a_dead_manager(monkeypatch):
    monkeypatch.setenv("RBPIPE_SPIN_US", "3000000")  # 3 s: any wait that ran the window out would show
    manager = start_manager()  # spawned with the variable: its connection threads poll as long
    try:
        registry = open_registry(manager, "wire", {"grpo_size": 2})
        t0 = time.monotonic()
        for _ in range(20):
            call(registry, "ping")
        assert time.monotonic() - t0 < 2.0  # each answer ends the poll at once
        manager._process.kill()
        manager._process.join(10)
        t0 = time.monotonic()
        with pytest.raises(ManagerDiedError):
            call(registry, "ping")
        assert time.monotonic() - t0 < 2.0  # a closed socket reads as ready: no poll to the end of the window
    finally:
        if manager._process.is_alive():
            manager.shutdown()


def test_a_bad_spin_setting_fails_before_a_manager_is_started(monkeypatch):
    monkeypatch.setenv("RBPIPE_SPIN_US", "soon")
    with pytest.raises(ConfigError, match="RBPIPE_SPIN_US"):
        start_manager()
