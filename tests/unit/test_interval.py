"""The periodic save interval (Young/Daly): the formula, its inputs, the attempts journal."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from preemptible import ConfigError
from preemptible.checkpoint._interval import (
    HOUR,
    PRIORS,
    History,
    SaveInterval,
    daly_interval,
    read_history,
)

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PREEMPTIBLE_MTBF", "PREEMPTIBLE_RUN_DIR", "PREEMPTIBLE_GRACE_PERIOD"):
        monkeypatch.delenv(name, raising=False)


def interval(**kw: object) -> SaveInterval:
    kw.setdefault("platform", "local")
    kw.setdefault("clock", Clock())
    kw.setdefault("min_interval", 1e-3)
    kw.setdefault("max_interval", 1e9)
    return SaveInterval(**kw)  # type: ignore[arg-type]


def expected_waste(tau: float, cost: float, mtbf: float) -> float:
    """Wall time per second of work with exponential interruptions and a save every tau
    seconds of work (Daly 2006, the exact model with no restart cost)."""
    return mtbf * math.expm1((tau + cost) / mtbf) / tau


# -- the formula ---------------------------------------------------------------------------
def test_daly_is_young_for_cheap_saves_and_bounded_for_expensive_ones() -> None:
    assert daly_interval(1.0, 1e6) == pytest.approx(math.sqrt(2e6), rel=1e-3)
    assert daly_interval(10.0, 3600.0) == pytest.approx(
        math.sqrt(2 * 10 * 3600) * (1 + (10 / 7200) ** 0.5 / 3 + (10 / 7200) / 9) - 10
    )
    assert daly_interval(100.0, 40.0) == 40.0  # C >= 2M: Daly's cut-off
    assert daly_interval(0.0, 3600.0) == 0.0
    assert daly_interval(5.0, math.inf) == math.inf


@pytest.mark.parametrize("mtbf", [600.0, 3600.0, 24 * HOUR])
@pytest.mark.parametrize("cost", [0.5, 10.0, 120.0])
def test_daly_interval_is_near_the_exact_optimum(cost: float, mtbf: float) -> None:
    tau = daly_interval(cost, mtbf)
    grid = [tau * 1.01**k for k in range(-300, 301)]
    best = min(expected_waste(t, cost, mtbf) for t in grid)
    assert expected_waste(tau, cost, mtbf) <= best * 1.005


# -- where the MTBF comes from -------------------------------------------------------------
def test_mtbf_argument_beats_the_environment_which_beats_history_and_prior(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    busy = History(uptime=10 * HOUR, interruptions=9, losses=9, attempts=10)
    assert interval(history=busy).mtbf()[0] == pytest.approx((7 * 24 * HOUR + 10 * HOUR) / 10)
    monkeypatch.setenv("PREEMPTIBLE_MTBF", "7200")
    assert interval(history=busy).mtbf() == (7200.0, "PREEMPTIBLE_MTBF")
    assert interval(mtbf=600, history=busy).mtbf() == (600.0, "mtbf argument")


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_bad_mtbf_environment_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("PREEMPTIBLE_MTBF", value)
    with pytest.raises(ConfigError) as err:
        interval()
    message = str(err.value)
    assert "PREEMPTIBLE_MTBF" in message and "seconds > 0" in message and "\n" not in message


def test_prior_then_posterior_then_live_uptime() -> None:
    clock = Clock()
    prior = interval(platform="gce", clock=clock)
    assert prior.mtbf() == (24 * HOUR, "gce prior of 24 h")
    # gamma-exponential: (1 prior interruption + 3 seen) in (24 h prior + 36 h of uptime)
    seen = History(uptime=36 * HOUR, interruptions=3, losses=0, attempts=4)
    posterior = interval(platform="gce", history=seen, clock=clock)
    mean, why = posterior.mtbf()
    assert mean == pytest.approx(15 * HOUR)
    assert why == "3 interruptions in 36 h of this run, with the gce prior of 24 h"
    clock.now = 4 * HOUR  # this attempt has run 4 h without an interruption
    assert posterior.mtbf()[0] == pytest.approx(16 * HOUR)
    assert interval(platform="gce", prior_mtbf=HOUR).mtbf() == (HOUR, "prior_mtbf of 60 min")


# -- notices ----------------------------------------------------------------------------
def test_notices_that_cover_a_save_stretch_the_interval() -> None:
    gce = interval(platform="gce", mtbf=HOUR)
    gce.observe_save(2.0)
    assert gce.unannounced()[0] == pytest.approx(0.1)
    assert gce.seconds() == pytest.approx(daly_interval(2.0, 10 * HOUR))
    local = interval(platform="local", mtbf=HOUR)
    local.observe_save(2.0)
    assert local.seconds() == pytest.approx(daly_interval(2.0, HOUR))


def test_a_notice_too_short_for_the_save_covers_nothing() -> None:
    ec2 = interval(platform="ec2", mtbf=HOUR)
    ec2.observe_save(90.0)  # 1.25 * 90 + 5 = 117.5 s fits the 120 s notice
    assert ec2.unannounced()[0] == pytest.approx(0.1)
    ec2.observe_save(100.0)
    ec2.observe_save(100.0)  # median 100 s: 130 s no longer fits
    share, why = ec2.unannounced()
    assert share == 1.0 and "too short" in why
    assert ec2.seconds() == pytest.approx(daly_interval(100.0, HOUR))


def test_notice_window_from_the_argument_then_grace_period_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PREEMPTIBLE_GRACE_PERIOD", "10")
    assert interval(platform="kubernetes").unannounced()[0] == 0.25  # 1.25 * 1 + 5 < 10
    k8s = interval(platform="kubernetes", save_cost=4.0)  # 1.25 * 4 + 5 = 10: too short
    assert k8s.unannounced()[0] == 1.0
    assert interval(platform="kubernetes", save_cost=4.0, notice_window=60).unannounced()[
        0
    ] == pytest.approx(0.25)


def test_history_updates_the_unannounced_share() -> None:
    # beta: (2 * 0.1 prior + 3 losses) / (2 + 4 interruptions)
    h = History(uptime=40 * HOUR, interruptions=4, losses=3, attempts=5)
    share, why = interval(platform="ec2", history=h).unannounced()
    assert share == pytest.approx(3.2 / 6)
    assert why.startswith("3 of 4 lost work in this run")
    assert interval(platform="ec2", history=h, unannounced=0.0).unannounced()[0] == 0.0


# -- save cost, adaptation, bounds, the per-step check ---------------------------------------
def test_first_save_is_early_with_the_assumed_cost() -> None:
    si = interval(mtbf=HOUR)
    cost, why = si.save_cost()
    assert cost == 1.0 and "assumed" in why
    assert si.seconds() == pytest.approx(daly_interval(1.0, HOUR))


def test_interval_adapts_after_a_save_time_change() -> None:
    si = interval(mtbf=10 * HOUR)
    for _ in range(5):
        si.observe_save(1.0)
    before = si.seconds()
    assert before == pytest.approx(daly_interval(1.0, 10 * HOUR))
    si.observe_save(16.0)
    si.observe_save(16.0)
    assert si.seconds() == before  # the median of the last 5 ignores two outliers
    si.observe_save(16.0)
    assert si.seconds() == pytest.approx(daly_interval(16.0, 10 * HOUR))
    assert si.seconds() / before == pytest.approx(4.0, rel=0.02)  # sqrt(16)
    assert si.save_cost() == (16.0, "median of 5 measured")


def test_bounds_and_async_write_time() -> None:
    si = interval(mtbf=60.0, min_interval=30.0, max_interval=600.0)
    si.observe_save(0.01)
    assert si.seconds() == 30.0 and "raised to the 30 s minimum" in si.describe()
    si = interval(mtbf=1e9, min_interval=30.0, max_interval=600.0)
    si.observe_save(5.0)
    assert si.seconds() == 600.0 and "capped" in si.describe()
    si = interval(mtbf=60.0, min_interval=30.0)
    si.observe_save(0.01, write=45.0)  # async: the training loop stalled 10 ms, the write took 45 s
    assert si.seconds() == 45.0 and "background write" in si.describe()
    si.observe_save(float("nan"))  # ignored
    assert si.seconds() == 45.0


def test_due_compares_with_the_end_of_the_last_save() -> None:
    si = interval(mtbf=HOUR)
    si.observe_save(2.0)
    t = si.seconds()
    assert not si.due(now=100.0 + t - 0.001, last_save_at=100.0)
    assert si.due(now=100.0 + t, last_save_at=100.0)


def test_fixed_interval() -> None:
    si = interval(every=300.0)
    si.observe_save(50.0)
    assert si.seconds() == 300.0
    assert si.describe() == "every 5 min (fixed: save_every_seconds)"


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"mtbf": 0}, "mtbf=0"),
        ({"mtbf": float("nan")}, "mtbf=nan"),
        ({"mtbf": True}, "mtbf=True"),
        ({"mtbf": math.inf}, "mtbf=inf"),
        ({"mtbf": 10**400}, "mtbf=1000"),
        ({"every": -1}, "every=-1"),
        ({"unannounced": 1.5}, "unannounced=1.5"),
        ({"notice_window": -1}, "notice_window=-1"),
        ({"platform": "mars"}, "platform='mars'"),
        ({"min_interval": 60, "max_interval": 10}, "max_interval=10"),
    ],
)
def test_bad_arguments_are_one_clear_line(kw: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError) as err:
        interval(**kw)
    assert str(err.value).startswith(named) and "\n" not in str(err.value)


def test_describe_is_one_line_naming_every_input() -> None:
    h = History(uptime=30 * HOUR, interruptions=2, losses=1, attempts=3)
    si = SaveInterval(platform="ec2", history=h, clock=Clock())
    si.observe_save(3.0)
    line = si.describe()
    assert "\n" not in line
    for part in ("Young/Daly", "save 3.0 s (measured)", "2 interruptions in 30 h", "ec2 prior"):
        assert part in line
    assert line.startswith(f"every {round(si.seconds() / 60)} min")


def test_every_platform_has_a_documented_prior() -> None:
    from preemptible.notices import PLATFORMS

    assert set(PRIORS) == set(PLATFORMS)
    for prior in PRIORS.values():
        assert prior.mtbf > 0 and 0 < prior.unannounced <= 1 and prior.window > 0 and prior.source


# -- the attempts journal ------------------------------------------------------------------
def write_run(
    root: Path, attempts: list[dict[str, object]], extra: list[str] | None = None
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(a) for a in attempts] + (extra or [])
    (root / "attempts.jsonl").write_text("\n".join(lines) + "\n")
    for a in attempts:
        (root / f"attempt-{a['attempt']}").mkdir(exist_ok=True)
    return root


def stopped(root: Path, number: int) -> None:
    record = {"state": "stopped", "checkpoint": "/ckpt/step-10.ckpt", "signum": 15}
    (root / f"attempt-{number}" / "record.json").write_text(json.dumps(record))


def line(number: int, state: str, duration: float) -> dict[str, object]:
    return {"attempt": number, "state": state, "duration_s": duration, "exit_code": 0}


def test_journal_gives_the_expected_history_and_interval(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "run",
        [
            line(1, "PREEMPTED", 5 * HOUR),  # stopped with a final checkpoint: covered
            line(2, "CRASHED", 3 * HOUR),  # SIGKILL: lost work
            line(3, "PREEMPTED", 4 * HOUR),  # no final checkpoint: lost work
            line(4, "FAILED", 1 * HOUR),  # a bug: exposure, not an interruption
        ],
        extra=[
            "not json",
            "[1, 2]",
            json.dumps(line(9, "EXPLODED", 10)),
            json.dumps(line(9, "CRASHED", -1)),
            json.dumps({"attempt": True, "state": "CRASHED", "duration_s": 1}),
            json.dumps({"attempt": 9, "state": "CRASHED", "duration_s": True}),
            '{"attempt": 9, "state": "CRASHED", "duration_s": NaN}',
            json.dumps(line(9, "CRASHED", 1e12)),
            '{"attempt": 9, "state": "CRASHED", "duration_s": 1%s}' % ("0" * 400),
            "[" * 100_000,
            "",
        ],
    )
    stopped(run, 1)
    (run / "attempt-3" / "record.json").write_text('{"state": "stopping"}')
    (run / "attempt-5").mkdir()  # vanished with its supervisor: the machine was lost
    (run / "attempt-6").mkdir()  # vanished too, but after committing its final checkpoint
    stopped(run, 6)
    (run / "attempt-7").mkdir()  # the newest: running now
    (run / "attempt-x").mkdir()  # not an attempt
    h = read_history(run)
    assert h == History(uptime=13 * HOUR, interruptions=5, losses=3, attempts=4, skipped=10)

    si = SaveInterval(run_dir=run, platform="ec2", clock=Clock())
    si.observe_save(2.0)
    mtbf = (24 * HOUR + 13 * HOUR) / (1 + 5)  # 6.2 h
    share = (2 * 0.1 + 3) / (2 + 5)  # 0.457
    assert si.mtbf()[0] == pytest.approx(mtbf)
    assert si.unannounced()[0] == pytest.approx(share)
    assert si.seconds() == pytest.approx(daly_interval(2.0, mtbf / share))
    assert round(si.seconds()) == 439  # sqrt(2 * 2 s * 13.5 h), Daly-corrected


def test_journal_found_through_preemptible_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = write_run(tmp_path / "run", [line(1, "CRASHED", HOUR)])
    (run / "attempt-2").mkdir()
    monkeypatch.setenv("PREEMPTIBLE_RUN_DIR", str(run / "attempt-2"))
    si = SaveInterval(platform="local", clock=Clock())
    assert si.history == History(uptime=HOUR, interruptions=1, losses=1, attempts=1)
    assert si.mtbf()[0] == pytest.approx((7 * 24 * HOUR + HOUR) / 2)


def test_missing_or_odd_journal_is_no_history(tmp_path: Path) -> None:
    assert read_history(tmp_path / "nowhere") == History()
    (tmp_path / "attempts.jsonl").mkdir()
    assert read_history(tmp_path) == History()


def test_fifos_are_not_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "attempts.jsonl")
    os.mkfifo(tmp_path / "attempt-1")  # not an attempt directory either
    assert read_history(tmp_path) == History()
    run = write_run(tmp_path / "run", [line(1, "PREEMPTED", 60.0)])
    os.mkfifo(run / "attempt-1" / "record.json")  # opening it would block
    assert read_history(run) == History(uptime=60.0, interruptions=1, losses=1, attempts=1)


def test_only_the_tail_of_a_huge_journal_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import preemptible.checkpoint._history as interval_module

    monkeypatch.setattr(interval_module, "JOURNAL_MAX_BYTES", 1000)
    old = [line(n, "CRASHED", 1.0) for n in range(1, 200)]
    new = [line(n, "FINISHED", 2.0) for n in range(200, 205)]
    write_run(tmp_path, old + new)
    for n in range(1, 205):
        (tmp_path / f"attempt-{n}").rmdir()
    h = read_history(tmp_path)
    assert h.skipped == 0 and 5 <= h.attempts < 30
    assert h.uptime == pytest.approx(5 * 2.0 + (h.attempts - 5) * 1.0)


def test_importing_it_is_light() -> None:
    code = (
        "import sys, preemptible.checkpoint._interval; "
        "bad = [m for m in ('torch', 'numpy', 'preemptible.supervisor') "
        "if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_save_cost_an_earlier_attempt_measured_is_the_first_guess(tmp_path: Path) -> None:
    run = write_run(tmp_path, [line(1, "PREEMPTED", HOUR), line(2, "CRASHED", HOUR)])
    (run / "attempt-1" / "record.json").write_text(json.dumps({"save_s": 12.5}))
    (run / "attempt-2" / "record.json").write_text(json.dumps({"save_s": True}))
    (run / "attempt-3").mkdir()
    (run / "attempt-3" / "record.json").write_text('{"save_s": NaN}')
    si = SaveInterval(run_dir=run, platform="local", mtbf=HOUR, clock=Clock())
    assert si.save_cost() == (12.5, "measured by an earlier attempt")
    assert si.seconds() == pytest.approx(daly_interval(12.5, HOUR))
    (run / "attempt-2" / "record.json").write_text(json.dumps({"save_s": 40}))
    assert read_history(run).save_cost == 40.0  # the newest attempt's measurement wins
    si.observe_save(3.0)
    assert si.save_cost() == (3.0, "measured")
