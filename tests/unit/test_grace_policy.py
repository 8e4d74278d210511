"""The grace policy on a virtual clock: one more step + final save + exit before the deadline.

Each scenario plays many seeded notices: steps and saves with jitter, the measurements the
handler would have, and the real (drawn) durations the policy cannot know in advance. The
process must be gone (final save committed AND exit done) before the deadline in every trial,
and the policy must still use the window.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import pytest

from preemptible import ConfigError, Notice, TerminationConfig
from preemptible.stop._controller import StopController
from preemptible.stop._termination import (
    DECISION_MARGIN,
    EXIT_PRIOR_SPREAD,
    EXIT_TIME,
    Durations,
    StopRequests,
)


@dataclass
class Played:
    slack: float  # deadline - the moment the process is gone
    trained: float  # seconds of training after the notice, all in the final checkpoint
    usable: float  # the window less the time spent saving and exiting
    left_at_stop: float  # deadline - the moment the final save started


def play(
    rng: random.Random,
    *,
    window: float,
    step: float,
    save: float,
    step_jitter: float = 0.2,
    save_jitter: float = 0.1,
    saves_before: int = 4,
    exit_mean: float = 0.4,
    spikes: float = 0.0,
    latency: float = 0.0,
) -> Played:
    """One notice: insurance save, steps while the policy allows, final save, exit."""

    def step_time() -> float:
        d = step * rng.uniform(1 - step_jitter, 1 + step_jitter)
        return d * 3 if rng.random() < spikes else d  # a stall (GC, data loader)

    def save_time() -> float:
        return save * rng.uniform(1 - save_jitter, 1 + save_jitter)

    def exit_time() -> float:
        return exit_mean * rng.uniform(0.75, 1.5)

    steps = Durations(values=[step_time() for _ in range(16)])
    saves = Durations(values=[save_time() for _ in range(saves_before)])
    exits = Durations(prior_spread=EXIT_PRIOR_SPREAD, values=[exit_time()])
    # the platform's real deadline is `window`; a notice seen `latency` late that only knows
    # its window counts it from when it was seen, and says so
    seen = rng.uniform(0, latency)
    requests = StopRequests()
    requests.add(
        Notice(source="t", received_at=seen, deadline=seen + window, detection_latency=latency)
    )

    def must_stop(now: float) -> bool:
        return requests.must_stop_now(
            now=now, save_time=saves, step_time=steps, safety=1.25, exit_time=exits
        )

    t = seen
    used = 0.0  # saving and exiting
    if not must_stop(t):
        d = save_time()  # insurance
        saves.add(d)
        t += d
        used += d
    trained = 0.0
    while not must_stop(t):
        d = step_time()
        steps.add(d)
        t += d
        trained += d
    left = window - t
    d = save_time() + exit_time()
    t += d
    used += d
    return Played(slack=window - t, trained=trained, usable=window - used, left_at_stop=left)


SCENARIOS = {
    "long saves": {"window": 120.0, "step": 1.0, "save": 30.0},
    "long steps": {"window": 120.0, "step": 4.0, "save": 2.0},
    "jittery steps": {"window": 60.0, "step": 0.5, "save": 5.0, "step_jitter": 0.6},
    "stalling steps": {"window": 60.0, "step": 0.5, "save": 5.0, "spikes": 0.05},
    "short window": {"window": 30.0, "step": 0.2, "save": 2.0},
    "no saves before": {"window": 120.0, "step": 0.5, "save": 20.0, "saves_before": 0},
    "GCE, one poll late": {"window": 30.0, "step": 0.25, "save": 2.0, "latency": 1.0},
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_process_is_gone_before_the_deadline(name: str) -> None:
    rng = random.Random(name)
    runs = [play(rng, **SCENARIOS[name]) for _ in range(200)]  # type: ignore[arg-type]
    worst = min(r.slack for r in runs)
    assert worst > 0, f"{name}: the process was still there {-worst:.2f} s after the deadline"
    assert all(r.trained > 0 for r in runs), f"{name}: trained nothing after the notice"


def test_a_long_save_leaves_less_of_the_window_unused_than_a_flat_factor() -> None:
    """30 s saves, 1 s steps, 2 minutes, 8 saves measured before: the old 1.25 * (save + 2
    steps) margin started the final save with more than 42 s left; a budget from the measured
    spread needs far less, and 90 % of the window not spent saving or exiting is training."""
    rng = random.Random(5)
    runs = [play(rng, window=120.0, step=1.0, save=30.0, saves_before=8) for _ in range(200)]
    assert min(r.slack for r in runs) > 0
    assert max(r.left_at_stop for r in runs) < 40.0
    assert statistics.median(r.trained / r.usable for r in runs) >= 0.9


def test_only_one_more_step_has_to_fit() -> None:
    # deadline 100; steps, saves and exits measured 16 times each, all alike
    steps = Durations(values=[4.0] * 16)
    saves = Durations(values=[10.0] * 16)
    exits = Durations(values=[0.5] * 16)
    r = StopRequests()
    r.add(Notice(source="ec2", received_at=0.0, deadline=100.0))
    kw = {"save_time": saves, "step_time": steps, "safety": 1.25, "exit_time": exits}
    needed = steps.bound(1.25) + saves.bound(1.25) + exits.bound(1.25) + DECISION_MARGIN
    assert needed < 4.0 + 4.0 + 10.0  # one step and a little margin, not two steps
    assert not r.must_stop_now(now=100.0 - needed - 0.01, **kw)
    assert r.must_stop_now(now=100.0 - needed, **kw)


def test_the_exit_is_budgeted() -> None:
    r = StopRequests()
    r.add(Notice(source="ec2", received_at=0.0, deadline=100.0))
    kw = {"save_time": 10.0, "step_time": 1.0, "safety": 1.25}
    now = 100.0 - (12.25 + 1.225 + DECISION_MARGIN) - 1.0  # 1 s to spare without an exit
    assert not r.must_stop_now(now=now, exit_time=0.0, **kw)
    assert r.must_stop_now(now=now, exit_time=3.0, **kw)
    # the default, until measured: EXIT_TIME as one measurement
    default = Durations(prior_spread=EXIT_PRIOR_SPREAD, values=[EXIT_TIME]).bound(1.25)
    assert 1.4 < default < 1.6
    assert r.must_stop_now(now=now + 1.0 - default + 1e-9, **kw)
    assert not r.must_stop_now(now=now + 1.0 - default - 0.01, **kw)


def test_detection_latency_moves_the_deadline_earlier() -> None:
    exact = StopRequests()
    exact.add(Notice(source="ec2", received_at=0.0, deadline=30.0))
    late = StopRequests()
    late.add(Notice(source="gce", received_at=0.0, deadline=30.0, detection_latency=1.5))
    assert late.deadline() == 28.5
    kw = {"save_time": 2.0, "step_time": 0.1, "safety": 1.25, "exit_time": 0.4}
    now = 30.0 - 1.0 - (2.45 + 0.1225 + 0.805 + DECISION_MARGIN)
    assert not exact.must_stop_now(now=now, **kw)
    assert late.must_stop_now(now=now, **kw)
    # with a grace period instead of a deadline, the same
    grace = StopRequests(grace_period=30.0)
    grace.add(Notice(source="watcher", received_at=0.0, detection_latency=1.5))
    assert grace.deadline() == 28.5


@pytest.mark.parametrize("latency", [-1.0, float("nan"), float("inf"), "1"])
def test_detection_latency_is_validated(latency: object) -> None:
    with pytest.raises(ConfigError, match=r"detection_latency=.* is not valid; use seconds >= 0"):
        Notice(source="gce", detection_latency=latency)  # type: ignore[arg-type]


def test_plain_stop_is_at_once_whatever_the_durations() -> None:
    r = StopRequests()
    r.add(Notice(source="SIGTERM", received_at=50.0, signum=15))
    assert r.must_stop_now(
        now=50.0, save_time=Durations(), step_time=Durations(), safety=1.0, exit_time=0.0
    )


def test_early_warnings_never_stop_even_with_a_deadline() -> None:
    r = StopRequests(grace_period=10.0)
    r.add(Notice(source="ec2-rebalance", received_at=0.0, deadline=5.0, stop=False))
    for now in (0.0, 5.0, 1e9):
        assert not r.must_stop_now(now=now, save_time=30.0, step_time=4.0, safety=2.0)


def test_durations_bound() -> None:
    assert Durations().bound(1.25) == 0.0
    once = Durations(values=[10.0])
    assert once.spread() == pytest.approx(1.0)  # the prior: 10 % of the mean
    assert once.bound(1.25) == pytest.approx(12.25)
    assert once.bound(1.0) == pytest.approx(11.8)  # safety scales the spread term
    regular = Durations(values=[10.0 + (i % 2) * 0.2 for i in range(16)])
    assert regular.spread() < 0.4 < once.spread()  # mostly measured, not the prior
    assert regular.mean() + 0.2 < regular.bound(1.25) < 11.0
    stalled = Durations(values=[1.0] * 15 + [5.0])
    assert stalled.bound(1.25) == 5.0  # the longest recent one, when the spread says less
    assert len(Durations(window=3, values=[1.0, 2.0, 3.0, 4.0])) == 3


def test_more_safety_stops_earlier() -> None:
    r = StopRequests()
    r.add(Notice(source="ec2", received_at=0.0, deadline=100.0))
    saves = Durations(values=[20.0, 21.0, 19.0])
    kw = {"save_time": saves, "step_time": 1.0, "exit_time": 0.5}
    stops = {
        s: next(t / 10 for t in range(1000) if r.must_stop_now(now=t / 10, safety=s, **kw))
        for s in (1.0, 1.25, 2.0)
    }
    assert stops[1.0] > stops[1.25] > stops[2.0]


def test_exit_time_in_the_config() -> None:
    assert TerminationConfig().exit_time is None
    assert TerminationConfig(exit_time=3).exit_time == 3


def test_a_bucket_s_upload_counts_in_the_save_as_known_at_the_boundary() -> None:
    """A stop waits for its checkpoint's upload: the policy budgets the upload measured by the
    time it decides, also for saves made before any upload was measured (a notice's insurance
    checkpoint, the first one of its run)."""
    controller = StopController(TerminationConfig(), ())
    controller.step_times.add(0.1)
    controller.save_times.add(1.0)  # saved before its upload was measured
    controller.requests.add(Notice(source="ec2", received_at=time.time(), deadline=time.time() + 8))
    assert not controller.must_stop_now()
    known: list[float | None] = [None]
    controller.upload_time = lambda: known[0]
    assert not controller.must_stop_now()  # nothing uploaded yet: nothing known
    known[0] = 10.0  # the insurance checkpoint's upload took 10 s
    assert controller.save_time().max() == 11.0 and len(controller.save_time()) == 1
    assert controller.must_stop_now()
    assert controller.save_times.max() == 1.0  # the measurements themselves are kept


def test_durations_plus_shifts_every_value_and_keeps_the_spread() -> None:
    saves = Durations(values=[1.0, 2.0, 3.0], prior_spread=0.3)
    shifted = saves.plus(5.0)
    assert list(shifted._values) == [6.0, 7.0, 8.0] and shifted.prior_spread == 0.3
    assert shifted.bound(1.25) > saves.bound(1.25) + 4.9
