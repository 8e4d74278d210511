"""Grace policy with a fake clock, the watcher thread, and TerminationConfig validation."""

from __future__ import annotations

import logging
import threading

import pytest

from preemptible import ConfigError, Notice, TerminationConfig
from preemptible.stop._termination import (
    DECISION_MARGIN,
    EXIT_PRIOR_SPREAD,
    EXIT_TIME,
    Durations,
    StopRequests,
    Watcher,
)
from tests.conftest import wait_for


def _needed(*, save: float, step: float, exit: float, safety: float = 1.25) -> float:
    """What the policy budgets for single measurements (each taken as one)."""
    return (
        Durations(values=[step]).bound(safety)
        + Durations(values=[save]).bound(safety)
        + Durations(prior_spread=EXIT_PRIOR_SPREAD, values=[exit]).bound(safety)
        + DECISION_MARGIN
    )


def test_plain_stop_request_stops_at_once() -> None:
    r = StopRequests()
    assert not r.must_stop_now(now=0, save_time=0, step_time=0, safety=1.25)
    r.add(Notice(source="SIGTERM", received_at=100.0, signum=15))
    assert r.must_stop_now(now=100.0, save_time=50, step_time=50, safety=1.25)


def test_grace_period_without_a_notice_deadline_counts_from_the_notice() -> None:
    r = StopRequests(grace_period=120.0)
    r.add(Notice(source="SIGTERM", received_at=1000.0, signum=15))
    assert r.deadline() == 1120.0
    kw = {"save_time": 10.0, "step_time": 1.0, "safety": 1.25}
    needed = _needed(save=10.0, step=1.0, exit=EXIT_TIME)
    assert not r.must_stop_now(now=1000.0, **kw)
    assert not r.must_stop_now(now=1120.0 - needed - 0.01, **kw)
    assert r.must_stop_now(now=1120.0 - needed, **kw)


def test_save_time_is_not_ignored() -> None:
    r = StopRequests()
    r.add(Notice(source="ec2", received_at=0.0, deadline=120.0))
    assert not r.must_stop_now(now=100.0, save_time=0.0, step_time=1.0, safety=1.0)
    assert r.must_stop_now(now=100.0, save_time=19.0, step_time=1.0, safety=1.0)


def test_earliest_deadline_wins_and_a_later_signal_means_now() -> None:
    r = StopRequests()
    r.add(Notice(source="gce", received_at=0.0, deadline=30.0))
    r.add(Notice(source="azure", received_at=1.0, deadline=20.0))
    assert r.deadline() == 20.0
    r.add(Notice(source="SIGTERM", received_at=5.0, signum=15))
    assert r.deadline() == 5.0
    assert r.must_stop_now(now=5.0, save_time=0, step_time=0, safety=1.0)


def test_early_warning_is_not_a_stop() -> None:
    r = StopRequests()
    r.add(Notice(source="ec2-rebalance", stop=False))
    assert r and r.first_stop() is None and r.deadline() is None
    assert not r.must_stop_now(now=1e12, save_time=0, step_time=0, safety=1.0)


def test_exit_codes() -> None:
    assert Notice(source="SIGINT", signum=2).exit_code == 130
    assert Notice(source="SIGUSR1", signum=10).exit_code == 138
    assert Notice(source="gce").exit_code == 143


def test_durations() -> None:
    d = Durations(window=3)
    assert d.max() == 0.0 and d.median() == 0.0
    for v in (5.0, 1.0, 2.0, 3.0):
        d.add(v)
    assert len(d) == 3 and d.max() == 3.0 and d.median() == 2.0


def test_watcher_reports_within_one_poll_and_survives_exceptions(caplog) -> None:
    calls = {"n": 0}
    seen: list[Notice] = []

    def fn() -> bool:
        calls["n"] += 1
        if calls["n"] <= 3:
            raise RuntimeError("metadata server unreachable")
        return calls["n"] >= 5

    with caplog.at_level(logging.DEBUG, logger="preemptible"):
        w = Watcher(fn, seen.append, interval=0.01, name="test")
        w.start()
        wait_for(lambda: seen, 5, "a notice")
        w.stop()
    assert calls["n"] == 5
    assert seen[0].source == "test" and seen[0].stop
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "raised" in r.message]
    assert len(warnings) == 1, "an exception is logged once, then polling goes on"


def test_watcher_stop_ends_the_thread() -> None:
    w = Watcher(lambda: False, lambda n: None, interval=0.01, name="idle")
    w.start()
    w.stop()
    assert not any(t.name == "preemptible-idle" for t in threading.enumerate())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grace_period": -1}, "grace_period=-1 is not valid"),
        ({"grace_period": float("nan")}, "grace_period=nan"),
        ({"poll_interval": 0}, "poll_interval=0 is not valid"),
        ({"safety_factor": 0.5}, "safety_factor=0.5 is not valid"),
        ({"safety_factor": float("inf")}, "safety_factor=inf is not valid"),
        ({"exit_time": -0.1}, "exit_time=-0.1 is not valid"),
        ({"exit_time": float("nan")}, "exit_time=nan is not valid"),
        ({"exit_time": "1"}, "exit_time='1' is not valid"),
        ({"exit_fn": 3}, "exit_fn must be callable"),
    ],
)
def test_config_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TerminationConfig(**kwargs)  # type: ignore[arg-type]
