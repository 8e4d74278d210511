"""Hyperband early termination: the runs W&B's sweeps would stop, and one line per bad config.

The cases marked "W&B:" are the scenarios of wandb/sweeps' tests/test_hyperband_stopping.py
(same configs, same histories, same expected runs), written again here as plain histories.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from preemptible import ConfigError
from preemptible.sweeps.spec._hyperband import (
    ITER_LIMIT,
    Goal,
    Hyperband,
    bands,
    early_terminate_problem,
    parse_early_terminate,
    stop_decisions,
    thresholds,
)
from preemptible.sweeps.spec._spec import parse_spec


def hb(**raw: Any) -> Hyperband:
    return parse_early_terminate({"type": "hyperband", **raw})


def stops(
    config: Hyperband,
    histories: Mapping[str, Sequence[Any]],
    running: set[str] | None = None,
    goal: Goal = "minimize",
) -> set[str]:
    """Every run running unless ``running`` says which."""
    live = set(histories) if running is None else running
    return stop_decisions(config, goal=goal, histories=histories, running=live)


# -- W&B's cases -------------------------------------------------------------------------------
DOWN = [10 - i for i in range(10)]  # 10, 9, ..., 1: better at every step
FLAT = [10] * 4


@pytest.mark.parametrize(
    "config",
    [hb(min_iter=3, eta=3), hb(min_iter=3), hb(max_iter=81, eta=3, s=3)],
    ids=["min_iter", "eta-default", "max_iter"],
)
def test_wandb_flat_run_is_stopped_at_the_first_band(config: Hyperband) -> None:
    assert bands(config)[:3] == [3, 9, 27]
    assert stops(config, {"flat": FLAT, "down": DOWN}) == {"flat"}


def test_wandb_maximize_stops_the_flat_run_too() -> None:
    up = [10 + i for i in range(10)]
    assert stops(hb(min_iter=3, eta=3), {"flat": FLAT, "up": up}, goal="maximize") == {"flat"}
    # read as losses, the rising run is the bad one, once both are judged at band 3
    assert stops(hb(min_iter=3, eta=3), {"flat": FLAT, "up": up}) == set()  # up: at band 9
    assert stops(hb(min_iter=3, eta=3), {"flat": FLAT, "up": up[:4]}) == {"up"}


def test_wandb_bands_from_max_iter() -> None:
    config = hb(max_iter=18, eta=3, s=2)
    assert bands(config) == [2, 6]
    assert stops(config, {"flat": FLAT, "down": DOWN}) == {"flat"}


def test_wandb_a_single_run_is_never_stopped() -> None:
    assert stops(hb(max_iter=18, eta=3, s=2, strict=False), {"down": DOWN}) == set()


def test_wandb_a_run_that_catches_up_by_its_band_passes() -> None:
    config = hb(max_iter=18, eta=3, s=2, strict=False)
    assert stops(config, {"late": [10, 10, 6], "down": DOWN}) == set()


WANDB_FIVE = {"a": [10, 9], "b": [10, 10], "c": [10, 8, 8], "d": [10, 7, 7], "e": [10, 6, 6]}


def test_wandb_five_runs_the_worst_running_one_is_stopped() -> None:
    config = hb(max_iter=5, eta=2, s=2)
    assert bands(config) == [1, 2]
    assert stops(config, WANDB_FIVE, running={"b", "c", "d"}) == {"b"}


def test_wandb_five_runs_two_stopped_when_the_first_has_no_band_yet() -> None:
    histories = {"a": [10], "b": [11], "c": [10, 8, 8], "d": [10, 7, 7], "e": [10, 6, 6]}
    assert stops(hb(max_iter=5, eta=2, s=2), histories, running={"b", "c", "d"}) == {"b", "c"}


WANDB_ETA3 = {
    "a": [9, 8],  # finished
    "b": [11, 11],  # worse than everyone at band 1
    "c": [10, 8, 3],  # behind at band 1 but ahead by band 3
    "d": [10, 7, 4],
    "e": [10, 6, 6],  # passes band 1, not band 3
}


def test_wandb_eta_3_relaxed() -> None:
    config = hb(max_iter=9, eta=3, s=2, strict=False)
    assert bands(config) == [1, 3]
    running = {"b", "c", "d", "e"}
    assert thresholds(config, goal="minimize", histories=WANDB_ETA3) == {1: 10, 3: 4}
    assert stops(config, WANDB_ETA3, running=running) == {"b", "e"}


def test_wandb_eta_3_relaxed_maximize() -> None:
    histories = {
        "a": [-10, -9],
        "b": [-11, -11],
        "c": [-10, -8, -5, -3],
        "d": [-10, -6, -2],
        "e": [-10, -6, -6, -6],
    }
    config = hb(max_iter=9, eta=3, s=2, strict=False)
    running = {"b", "c", "d", "e"}
    assert thresholds(config, goal="maximize", histories=histories) == {1: -10, 3: -5}
    assert stops(config, histories, running=running, goal="maximize") == {"b", "e"}


def test_wandb_a_run_whose_metric_went_nan_is_judged_by_its_numbers_only() -> None:
    # max_iter 300, s 2, eta 3: bands 33 and 100; the NaN run has one number, so no band yet
    config = hb(max_iter=300, s=2, eta=3)
    assert bands(config) == [33, 100]
    rng = random.Random(7)
    histories: dict[str, list[Any]] = {
        "nan": [19.69, *["NaN"] * 30, *[math.nan] * 26],
        "d": [4 + rng.random() for _ in range(100)],
        "e": [4 + rng.random() for _ in range(61)],
    }
    assert stops(config, histories, running={"nan"}) == set()


def test_wandb_bad_config_is_refused() -> None:
    assert early_terminate_problem("hyperband") == (
        "early_terminate: must be a mapping, e.g. {type: hyperband, min_iter: 3}; "
        "not text 'hyperband'"
    )


# -- the rule, on curves of our own ------------------------------------------------------------
def curves(n: int, length: int, seed: int) -> dict[str, list[float]]:
    """``n`` distinct rising accuracy curves of ``length`` values."""
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        ceiling, speed = rng.uniform(0.5, 0.95), rng.uniform(0.02, 0.3)
        out[f"run{i}"] = [ceiling * (1 - math.exp(-speed * (t + 1))) for t in range(length)]
    return out


def test_strict_keeps_the_best_1_over_eta_at_each_band() -> None:
    config = hb(min_iter=30, eta=1.5, strict=True)
    assert bands(config)[:3] == [30, 45, 67]
    data = curves(60, 100, seed=3)
    alive = set(data)
    for band in bands(config)[:3]:
        seen = {run: data[run][: band + 5] for run in alive}  # a little past the band
        stopped = stops(config, seen, goal="maximize")
        n = len(seen)
        assert len(stopped) == n - 1 - int(n / 1.5)  # everyone below the int(n/eta)-th best
        at_band = sorted((seen[run][band - 1] for run in seen), reverse=True)
        assert {run for run in seen if seen[run][band - 1] < at_band[int(n / 1.5)]} == stopped
        alive -= stopped
    assert len(alive) == 60 - 19 - 13 - 9


def test_strict_stops_a_run_that_was_good_once_relaxed_spares_it() -> None:
    histories = {"steady": [5, 5, 5], "other": [6, 6, 6], "faded": [1, 9, 9]}
    strict = hb(max_iter=9, eta=3, s=2)  # bands 1 and 3
    relaxed = hb(max_iter=9, eta=3, s=2, strict=False)
    assert thresholds(strict, goal="minimize", histories=histories) == {1: 5, 3: 6}
    assert stops(strict, histories) == {"faded"}  # 9 at band 3 is worse than 6
    assert stops(relaxed, histories) == set()  # its best, 1, is not


def test_a_tie_with_the_threshold_is_not_stopped() -> None:
    assert stops(hb(max_iter=9, eta=3, s=2), {"a": [5], "b": [5], "c": [5]}) == set()


def test_a_run_is_judged_at_the_last_band_it_reached_only() -> None:
    # band 1: threshold 2 (b is worse); band 3: b alone reached it, so it sets its threshold
    histories = {"a": [1, 1], "b": [3, 3, 3], "c": [2]}
    assert stops(hb(max_iter=9, eta=3, s=2), histories) == set()
    assert stops(hb(max_iter=9, eta=3, s=2), {**histories, "b": [3, 3]}) == {"b"}


def test_values_that_are_not_finite_numbers_are_left_out_before_counting() -> None:
    config = hb(max_iter=9, eta=3, s=2)  # bands 1 and 3
    rubbish: list[Any] = [math.nan, math.inf, -math.inf, "NaN", None, True, 10**400]
    histories: dict[str, Sequence[Any]] = {"a": [5], "c": [6], "b": [*rubbish, 9]}
    assert stops(config, histories) == {"b"}  # b's first number, 9, is its iteration 1
    # b without a number is never stopped, and the others are compared without it
    assert stops(config, {**histories, "b": rubbish}) == {"c"}


def test_only_running_runs_with_a_history_are_returned() -> None:
    config = hb(max_iter=5, eta=2, s=2)
    assert stops(config, WANDB_FIVE, running=set()) == set()
    assert stops(config, WANDB_FIVE, running={"b", "ghost"}) == {"b"}
    # a finished run would be stopped if it were running; it never is
    assert stops(config, WANDB_FIVE, running={"c", "d"}) == set()
    worse = {**WANDB_FIVE, "a": [12, 12]}
    assert stops(config, worse, running={"c", "d"}) == set()
    assert stops(config, worse, running={"a"}) == {"a"}


def test_a_bad_goal_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="valid: minimize, maximize"):
        stop_decisions(hb(min_iter=1), goal="lowest", histories={}, running=set())  # type: ignore[arg-type]


# -- bands ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"max_iter": 81, "s": 3}, [3, 9, 27]),
        ({"max_iter": 81, "s": 10}, [1, 3, 9, 27]),  # none below 1
        ({"max_iter": 9, "s": 2, "eta": 3}, [1, 3]),
        ({"max_iter": 5, "s": 2, "eta": 2}, [1, 2]),
        ({"max_iter": 100, "s": 2, "eta": 1.5}, [44, 66]),
        ({"min_iter": 30, "eta": 1.5}, [30, 45, 67, 101, 151]),
        ({"min_iter": 3}, [3, 9, 27, 81]),
    ],
)
def test_bands(raw: dict[str, Any], expected: list[int]) -> None:
    assert bands(hb(**raw))[: len(expected)] == expected


def test_min_iter_bands_are_capped_and_each_appears_once() -> None:
    assert bands(hb(min_iter=3)) == [3**k for k in range(1, 20)] and ITER_LIMIT < 3**20
    close = bands(hb(min_iter=1, eta=1.01))  # W&B's 100 bands, many of them equal
    assert close == sorted(set(close)) and close[0] == 1 and close[-1] == int(1.01**99)
    assert bands(hb(min_iter=2, eta=1e300)) == [2]


# -- configs -----------------------------------------------------------------------------------
def test_defaults_and_both_forms() -> None:
    assert hb(min_iter=3) == Hyperband(min_iter=3, eta=3, strict=True)
    assert hb(max_iter=27, s=2, eta=1.5, strict=False) == Hyperband(
        max_iter=27, s=2, eta=1.5, strict=False
    )
    assert early_terminate_problem({"type": "hyperband", "min_iter": 1, "eta": 1.0001}) is None
    assert hb(min_iter=3).raw() == {"type": "hyperband", "min_iter": 3, "eta": 3, "strict": True}


HB = {"type": "hyperband"}
PROBLEMS: list[tuple[object, str]] = [
    (None, "early_terminate: must be a mapping, e.g. {type: hyperband, min_iter: 3}; not null"),
    ([1], "early_terminate: must be a mapping"),
    ({}, "early_terminate.type: required; valid: hyperband"),
    ({"type": "median", "min_iter": 3}, "early_terminate.type: 'median' is not valid; valid: "),
    ({"type": True, "min_iter": 3}, "early_terminate.type: True is not valid"),
    ({"type": ["hyperband"]}, "early_terminate.type: ['hyperband'] is not valid"),
    ({"min_iters": 3}, "early_terminate.min_iters: not a key of early_terminate; valid: type, "),
    ({1: 3}, "early_terminate: key 1 must be text; valid: type, min_iter, max_iter, s, eta"),
    ({"x\ny": 3}, "early_terminate['x\\ny']: not a key of early_terminate"),
    ({"type": "hyperband"}, "early_terminate: give min_iter (the first band), or max_iter and s"),
    ({**HB, "min_iter": 0}, "early_terminate.min_iter: must be an integer from 1 to 2147483647"),
    ({**HB, "min_iter": -3}, "early_terminate.min_iter: must be an integer from 1 to"),
    (
        {**HB, "min_iter": True},
        "early_terminate.min_iter: must be an integer from 1 to 2147483647 ",
    ),
    ({**HB, "min_iter": "3"}, "early_terminate.min_iter: must be an integer from 1 to 2147483647 "),
    ({**HB, "min_iter": 3.0}, "(the first band), not number 3.0"),
    ({**HB, "min_iter": 10**12}, "not integer 1000000000000"),
    ({**HB, "min_iter": 10**400}, "early_terminate.min_iter: must be an integer from 1 to"),
    ({**HB, "max_iter": 0, "s": 1}, "early_terminate.max_iter: must be an integer from 1 to"),
    ({**HB, "max_iter": 81, "s": 0}, "early_terminate.s: must be an integer from 1 to 100"),
    ({**HB, "max_iter": 81, "s": 101}, "early_terminate.s: must be an integer from 1 to 100"),
    ({**HB, "max_iter": 81, "s": 2.5}, "early_terminate.s: must be an integer from 1 to 100"),
    ({**HB, "max_iter": 81, "s": True}, "early_terminate.s: must be an integer"),
    ({**HB, "max_iter": 81, "s": 10**30}, "early_terminate.s: must be an integer"),
    ({**HB, "min_iter": 3, "eta": 1}, "early_terminate.eta: must be a finite number > 1"),
    ({**HB, "min_iter": 3, "eta": 0.5}, "early_terminate.eta: must be a finite number > 1"),
    ({**HB, "min_iter": 3, "eta": -2}, "early_terminate.eta: must be a finite number > 1"),
    ({**HB, "min_iter": 3, "eta": 0}, "early_terminate.eta: must be a finite number > 1"),
    ({**HB, "min_iter": 3, "eta": True}, "default 3), not true/false (True)"),
    ({**HB, "min_iter": 3, "eta": "3"}, "default 3), not text '3'"),
    ({**HB, "min_iter": 3, "eta": math.nan}, "default 3), not number nan"),
    ({**HB, "min_iter": 3, "eta": math.inf}, "default 3), not number inf"),
    ({**HB, "min_iter": 3, "eta": 10**400}, "early_terminate.eta: must be a finite number > 1"),
    ({**HB, "min_iter": 3, "strict": "yes"}, "early_terminate.strict: must be true or false"),
    ({**HB, "min_iter": 3, "strict": 1}, "(default true), not integer 1"),
    ({**HB, "min_iter": 3, "max_iter": 81, "s": 2}, "not min_iter with max_iter"),
    (
        {**HB, "min_iter": 3, "s": 2},
        "early_terminate: give min_iter, or max_iter and s, not min_iter with s",
    ),
    ({**HB, "max_iter": 81}, "early_terminate.s: required with max_iter"),
    ({**HB, "max_iter": 2, "s": 2}, "max_iter (2) / eta (3) is below 1, which leaves no band"),
    ({**HB, "max_iter": 3, "s": 2, "eta": 3.5}, "max_iter (3) / eta (3.5) is below 1"),
]


@pytest.mark.parametrize(("raw", "expected"), PROBLEMS)
def test_each_bad_config_is_one_line_naming_the_key(raw: object, expected: str) -> None:
    problem = early_terminate_problem(raw)
    assert problem is not None and expected in problem, problem
    assert len(problem.splitlines()) == 1 and problem.startswith("early_terminate")
    with pytest.raises(ConfigError) as info:
        parse_early_terminate(raw)
    assert str(info.value) == problem


def test_the_dataclass_checks_itself() -> None:
    with pytest.raises(ConfigError, match=r"early_terminate\.min_iter: must be an integer"):
        Hyperband(min_iter=0)
    with pytest.raises(ConfigError, match="early_terminate: give min_iter"):
        Hyperband()


def test_a_hostile_repr_does_not_escape() -> None:
    class Nasty:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    assert early_terminate_problem({"type": Nasty()}) == (
        "early_terminate.type: <Nasty> is not valid; valid: hyperband"
    )


# -- in the spec -------------------------------------------------------------------------------
SPEC: dict[str, Any] = {
    "program": "train.py",
    "method": "random",
    "metric": {"name": "val_loss"},
    "parameters": {"lr": {"min": 0.0001, "max": 0.1}},
}


def spec_error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_spec(data, source="spec.yaml")
    return str(info.value)


def test_the_spec_refuses_a_bad_early_terminate_with_its_line() -> None:
    bad = {**SPEC, "early_terminate": {"type": "hyperband", "min_iter": 3, "eta": 1}}
    assert spec_error(bad).startswith("spec.yaml: early_terminate.eta: must be a finite number > 1")
    bad["early_terminate"] = {"type": "median", "min_iter": 3}
    assert (
        spec_error(bad)
        == "spec.yaml: early_terminate.type: 'median' is not valid; valid: hyperband"
    )


def test_the_spec_needs_a_metric_for_early_terminate() -> None:
    data = {**SPEC, "early_terminate": {"type": "hyperband", "min_iter": 3}}
    del data["metric"]
    assert spec_error(data) == (
        "spec.yaml: metric: required for early_terminate, e.g. {name: val_loss, goal: minimize}"
    )


def test_a_good_early_terminate_is_kept_and_not_listed_as_ignored() -> None:
    data = {**SPEC, "early_terminate": {"type": "hyperband", "max_iter": 27, "s": 2}}
    parsed = parse_spec(data)
    assert parsed.ignored == ()
    assert parse_early_terminate(parsed.raw["early_terminate"]) == hb(max_iter=27, s=2)
    assert parse_spec({**SPEC, "early_terminate": None}).ignored == ()


# -- properties ----------------------------------------------------------------------------------
configs = st.one_of(
    st.builds(
        lambda m, eta, strict: hb(min_iter=m, eta=eta, strict=strict),
        st.integers(1, 6),
        st.sampled_from([1.5, 2, 3, 1.1]),
        st.booleans(),
    ),
    st.builds(
        lambda m, s, eta, strict: hb(max_iter=m * 3, s=s, eta=eta, strict=strict),
        st.integers(1, 12),
        st.integers(1, 4),
        st.sampled_from([1.5, 2, 3]),
        st.booleans(),
    ),
)
values = st.one_of(
    st.integers(-3, 3),
    st.floats(-3, 3),
    st.sampled_from([math.nan, math.inf, "NaN", None]),
)
histories_st = st.dictionaries(
    st.text("abcdef", min_size=1, max_size=3), st.lists(values, max_size=12), max_size=8
)


def numbers_in(history: Sequence[Any]) -> int:
    return sum(
        1
        for v in history
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    )


@settings(max_examples=300, deadline=None)
@given(configs, histories_st, st.sampled_from(["minimize", "maximize"]), st.randoms())
def test_decisions_depend_on_the_histories_only(
    config: Hyperband, histories: dict[str, list[Any]], goal: Goal, rnd: random.Random
) -> None:
    running = {run for run in histories if rnd.random() < 0.7}
    stopped = stop_decisions(config, goal=goal, histories=histories, running=running)
    assert stopped <= running
    first = bands(config)[0]
    assert all(numbers_in(histories[run]) >= first for run in stopped)  # never before band 1
    # the same runs under other ids, listed in another order
    ids = list(histories)
    renamed = ids[:]
    rnd.shuffle(renamed)
    new = dict(zip(ids, renamed, strict=True))
    order = ids[:]
    rnd.shuffle(order)
    moved = {new[run]: histories[run] for run in order}
    again = stop_decisions(config, goal=goal, histories=moved, running={new[r] for r in running})
    assert again == {new[run] for run in stopped}


@settings(max_examples=200, deadline=None)
@given(
    configs,
    st.dictionaries(
        st.text("abcdef", min_size=1, max_size=3),
        st.lists(st.integers(-50, 50), max_size=12),
        max_size=8,
    ),
)
def test_maximizing_a_metric_is_minimizing_its_negation(
    config: Hyperband, histories: dict[str, list[int]]
) -> None:
    negated = {run: [-v for v in h] for run, h in histories.items()}
    running = set(histories)
    assert stop_decisions(
        config, goal="maximize", histories=histories, running=running
    ) == stop_decisions(config, goal="minimize", histories=negated, running=running)


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
        lambda c: (
            st.lists(c, max_size=3)
            | st.dictionaries(
                st.sampled_from(["type", "min_iter", "max_iter", "s", "eta", "strict"])
                | st.text(max_size=3),
                c,
                max_size=6,
            )
        ),
        max_leaves=12,
    )
)
def test_any_value_is_a_config_or_one_line(raw: object) -> None:
    problem = early_terminate_problem(raw)
    if problem is None:
        assert bands(parse_early_terminate(raw))
    else:
        assert len(problem.splitlines()) == 1 and problem.startswith("early_terminate")
