"""The samplers: grid order, deterministic draws within bounds, and bayes beating random."""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from preemptible import ConfigError
from preemptible.sweeps.spec._sample import N_STARTUP, Observation, propose
from preemptible.sweeps.spec._spec import parse_spec
from tests.unit.sweep_strategies import canonical, check_params, valid_spec


def make(method: str, parameters: dict[str, Any], **extra: Any) -> Any:
    data = {"program": "t.py", "method": method, "parameters": parameters, **extra}
    if method == "bayes":
        data.setdefault("metric", {"name": "m"})
    return parse_spec(data)


def test_grid_counts_like_nested_loops_over_names_in_alphabetical_order() -> None:
    s = make("grid", {"b": {"values": [1, 2]}, "a": {"values": ["x", "y", "z"]}})
    points = [propose(s, [], index=i, seed=0) for i in range(7)]
    assert points[:6] == [
        {"b": 1, "a": "x"},
        {"b": 2, "a": "x"},
        {"b": 1, "a": "y"},
        {"b": 2, "a": "y"},
        {"b": 1, "a": "z"},
        {"b": 2, "a": "z"},
    ]
    assert [list(p) for p in points[:6]] == [["b", "a"]] * 6  # keys in the order written
    assert points[6] is None
    assert propose(s, [], index=10**9, seed=0) is None


def test_grid_enumerates_ranges_and_nested_groups() -> None:
    s = make(
        "grid",
        {
            "opt": {"parameters": {"lr": {"values": [0.1, 0.01]}, "wd": {"value": 0}}},
            "k": {"distribution": "q_uniform", "min": 0.3, "max": 0.5, "q": 0.1},
            "n": {"min": 1, "max": 2},
        },
    )
    points = [propose(s, [], index=i, seed=0) for i in range(8)]
    assert points[0] == {"opt": {"lr": 0.1, "wd": 0}, "k": 0.3, "n": 1}
    assert [p["k"] for p in points if p is not None] == [0.3] * 4 + [0.4] * 4
    # W&B's arange(0.3, 0.5, 0.1): max left out, and 0.4, not 0.4000000000000001
    assert {p["k"] for p in points if p is not None} == {0.3, 0.4}
    assert len({canonical(p) for p in points}) == 8 == s.grid_size()
    assert propose(s, [], index=8, seed=0) is None


@pytest.mark.parametrize(
    ("q_uniform", "expected"),
    [
        ({"min": 0, "max": 1, "q": 0.25}, [0.0, 0.25, 0.5, 0.75]),
        ({"min": 0.05, "max": 0.5, "q": 0.1}, [0.05, 0.15, 0.25, 0.35, 0.45]),
        ({"min": 0, "max": 10, "q": 2}, [0, 2, 4, 6, 8]),  # integers, as numpy's arange gives
        ({"min": 0.5, "max": 3, "q": 1}, [0.5, 1.5, 2.5]),
    ],
)
def test_grid_runs_q_uniform_as_wandbs_grid_does(
    q_uniform: dict[str, Any], expected: list[Any]
) -> None:
    s = make("grid", {"a": {"distribution": "q_uniform", **q_uniform}})
    got = [propose(s, [], index=i, seed=0) for i in range(len(expected) + 1)]
    assert got[-1] is None
    values = [p["a"] for p in got[:-1] if p is not None]
    assert values == expected
    assert [type(v) for v in values] == [type(v) for v in expected]


def test_grid_runs_equal_values_once_as_wandb_does() -> None:
    s = make("grid", {"a": {"values": [1, 1.0, True]}, "b": {"values": ["x", "x"]}})
    assert [propose(s, [], index=i, seed=0) for i in range(3)] == [
        {"a": 1, "b": "x"},
        {"a": True, "b": "x"},
        None,
    ]


def test_random_draws_a_value_written_twice_twice_as_often() -> None:
    for method in ("random", "bayes"):  # bayes draws at random until N_STARTUP runs finished
        s = make(method, {"a": {"values": ["x", "x", "y"]}})
        drawn = [propose(s, [], index=i, seed=0)["a"] for i in range(600)]  # type: ignore[index]
        assert 340 < drawn.count("x") < 460, drawn.count("x")  # 400 expected


def test_q_variants_are_rounded_but_not_clamped_to_min_and_max_as_in_wandb() -> None:
    s = make(
        "random",
        {
            "qu": {"distribution": "q_uniform", "min": 0.02, "max": 0.5, "q": 0.1},
            "qlv": {"distribution": "q_log_uniform_values", "min": 1, "max": 11, "q": 4},
            "qlu": {"distribution": "q_log_uniform", "min": 0, "max": math.log(11), "q": 4},
            "qb": {"distribution": "q_beta", "a": 0.5, "b": 0.5, "q": 0.3},
        },
    )
    seen: dict[str, set[Any]] = {name: set() for name in s.parameters}
    for i in range(400):
        p = propose(s, [], index=i, seed=5)
        assert p is not None
        for name, value in p.items():
            seen[name].add(value)
    assert seen["qu"] == {0.0, 0.1, 0.2, 0.3, 0.4, 0.5}  # round(0.04 / 0.1) is 0
    assert seen["qlv"] == seen["qlu"] == {0, 4, 8, 12}  # 12 > max, as W&B's round(x / q) * q
    assert seen["qb"] == {0.0, 0.3, 0.6, 0.9}  # round(1 / 0.3) is 3


def test_wandbs_other_distributions_draw_what_wandb_draws() -> None:
    s = make(
        "random",
        {
            "inv": {"distribution": "inv_log_uniform", "min": 0, "max": 2},
            "invv": {"distribution": "inv_log_uniform_values", "min": 0.01, "max": 1},
            "beta": {"distribution": "beta", "a": 2, "b": 6},
            "p": {
                "distribution": "categorical_w_probabilities",
                "values": ["x", "y"],
                "probabilities": [0.2, 0.8],
            },
        },
    )
    draws = [propose(s, [], index=i, seed=11) for i in range(2000)]
    assert draws == [propose(s, [], index=i, seed=11) for i in range(2000)]  # reproducible
    assert draws != [propose(s, [], index=i, seed=12) for i in range(2000)]
    inv = [p["inv"] for p in draws if p is not None]
    assert all(math.exp(-2) <= x <= 1.0 for x in inv)
    # W&B's exp(-u), u uniform on [min, max]: -log(x) has mean (min + max) / 2
    assert abs(statistics.mean(-math.log(x) for x in inv) - 1.0) < 0.05
    invv = [p["invv"] for p in draws if p is not None]
    assert all(0.01 <= x <= 1 for x in invv)
    assert abs(statistics.mean(math.log(x) for x in invv) - math.log(0.1)) < 0.1
    beta = [p["beta"] for p in draws if p is not None]
    assert all(0.0 <= x <= 1.0 for x in beta)
    assert abs(statistics.mean(beta) - 2 / 8) < 0.02  # a / (a + b)
    assert 300 < [p["p"] for p in draws if p is not None].count("x") < 500  # 400 expected


def test_run_cap_ends_every_method() -> None:
    for method in ("grid", "random", "bayes"):
        s = make(method, {"a": {"values": [1, 2, 3]}}, run_cap=2)
        assert propose(s, [], index=1, seed=0) is not None
        assert propose(s, [], index=2, seed=0) is None


@pytest.mark.parametrize("index", [-1, True, 1.0, "0"])
def test_a_bad_index_is_a_config_error(index: Any) -> None:
    s = make("random", {"a": {"values": [1]}})
    with pytest.raises(ConfigError, match=r"index=.* is not valid; use an integer >= 0"):
        propose(s, [], index=index, seed=0)


def test_random_is_a_function_of_seed_and_index_only() -> None:
    s = make("random", {"lr": {"distribution": "log_uniform_values", "min": 1e-5, "max": 1e-1}})
    first = [propose(s, [], index=i, seed=7) for i in range(20)]
    history = [Observation({"lr": 0.01}, 0.5, True)]
    assert [propose(s, history, index=i, seed=7) for i in range(20)] == first
    assert len({p["lr"] for p in first if p is not None}) == 20
    assert [propose(s, [], index=i, seed=8) for i in range(20)] != first


def test_adding_a_parameter_leaves_the_others_draws_alone() -> None:
    one = make("random", {"lr": {"min": 0.0, "max": 1.0}})
    two = make("random", {"bs": {"values": [16, 32]}, "lr": {"min": 0.0, "max": 1.0}})
    for i in range(10):
        a, b = propose(one, [], index=i, seed=3), propose(two, [], index=i, seed=3)
        assert a is not None and b is not None and a["lr"] == b["lr"]


def test_probabilities_weight_the_values() -> None:
    s = make("random", {"a": {"values": ["x", "y", "z"], "probabilities": [0.0, 1.0, 0.0]}})
    assert {propose(s, [], index=i, seed=0)["a"] for i in range(50)} == {"y"}  # type: ignore[index]
    s = make("random", {"a": {"values": ["x", "y"], "probabilities": [0.9, 0.1]}})
    drawn = [propose(s, [], index=i, seed=0)["a"] for i in range(400)]  # type: ignore[index]
    assert 300 < drawn.count("x") < 400


def test_q_variants_give_multiples_of_q_and_integers_for_an_integer_q() -> None:
    s = make(
        "random",
        {
            "f": {"distribution": "q_uniform", "min": 0.0, "max": 1.0, "q": 0.1},
            "i": {"distribution": "q_log_uniform_values", "min": 1, "max": 1000, "q": 8},
            "n": {"distribution": "q_normal", "mu": 0, "sigma": 10, "q": 5},
        },
    )
    for i in range(50):
        p = propose(s, [], index=i, seed=1)
        assert p is not None
        assert p["f"] in {round(0.1 * k, 1) for k in range(11)}
        assert type(p["i"]) is int and p["i"] % 8 == 0 and 0 <= p["i"] <= 1000
        assert type(p["n"]) is int and p["n"] % 5 == 0


def test_a_proposal_is_a_copy_of_the_spec_values() -> None:
    s = make("random", {"layers": {"values": [[64, 64]]}, "c": {"value": {"k": [1]}}})
    p = propose(s, [], index=0, seed=0)
    assert p == {"layers": [64, 64], "c": {"k": [1]}}
    p["layers"].append(1)
    p["c"]["k"].append(2)
    assert propose(s, [], index=0, seed=0) == {"layers": [64, 64], "c": {"k": [1]}}


def finished(spec: Any, n: int, seed: int = 0) -> list[Observation]:
    """``n`` finished runs of ``spec`` whose metric is the sum of their numeric values."""
    out = []
    for i in range(n):
        p = propose(spec, out, index=i, seed=seed)
        assert p is not None
        out.append(Observation(p, _score(p), True))
    return out


def _score(value: Any) -> float:
    if isinstance(value, dict):
        return sum(_score(v) for v in value.values())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return float(len(json.dumps(value)))


def test_bayes_samples_randomly_until_enough_runs_have_finished() -> None:
    params = {"x": {"min": -5.0, "max": 5.0}}
    bayes, rand = make("bayes", params), make("random", params)
    history = [
        *finished(rand, N_STARTUP - 1),
        Observation({"x": 1.0}, None, True),  # reported no metric
        Observation({"x": 2.0}, 0.1, False),  # still running
        Observation({"x": 3.0}, float("nan"), True),
    ]
    for i in range(5):
        assert propose(bayes, history, index=i, seed=4) == propose(rand, [], index=i, seed=4)


def test_bayes_without_optuna_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    s = make("bayes", {"x": {"min": 0.0, "max": 1.0}})
    history = finished(s, N_STARTUP)
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna raises ImportError
    with pytest.raises(ConfigError) as info:
        propose(s, history, index=N_STARTUP, seed=0)
    assert str(info.value) == (
        "method: bayes needs Optuna, which is not installed here; pip install 'preemptible[bayes]'"
    )


def test_bayes_is_deterministic_and_ignores_the_order_of_the_history() -> None:
    s = make(
        "bayes",
        {
            "x": {"min": -5.0, "max": 5.0},
            "opt": {"parameters": {"name": {"values": ["adam", "sgd"]}, "k": {"min": 1, "max": 9}}},
        },
    )
    history = finished(s, 12)
    expected = propose(s, history, index=12, seed=5)
    assert expected is not None and set(expected["opt"]) == {"name", "k"}
    shuffled = list(history)
    random.Random(1).shuffle(shuffled)
    assert propose(s, shuffled, index=12, seed=5) == expected
    unfinished = [*history, Observation({"x": 0.0, "opt": {"name": "sgd", "k": 1}}, None, False)]
    assert propose(s, unfinished, index=12, seed=5) == expected
    assert propose(s, history, index=13, seed=5) != expected


def test_bayes_skips_runs_this_spec_could_not_have_proposed() -> None:
    s = make("bayes", {"x": {"min": 0.0, "max": 1.0}, "c": {"values": ["a", "b"]}})
    history = finished(s, N_STARTUP)
    odd = [
        Observation({"x": 7.0, "c": "a"}, 0.0, True),  # out of bounds
        Observation({"x": 0.5, "c": "z"}, 0.0, True),  # not one of the values
        Observation({"c": "a"}, 0.0, True),  # no x
        Observation({"x": "0.5", "c": "a"}, 0.0, True),  # not a number
    ]
    assert propose(s, history + odd, index=9, seed=0) == propose(s, history, index=9, seed=0)


EVERY_DISTRIBUTION: dict[str, Any] = {
    "c": {"value": [1, 2]},
    "cat": {"values": [[64], {"k": 1}, "x"]},
    "i": {"min": -3, "max": 3},
    "u": {"min": 0.0, "max": 1.0},
    "qu": {"distribution": "q_uniform", "min": 0, "max": 10, "q": 2},
    "lv": {"distribution": "log_uniform_values", "min": 1e-5, "max": 0.1},
    "qlv": {"distribution": "q_log_uniform_values", "min": 1, "max": 100, "q": 0.5},
    "lu": {"distribution": "log_uniform", "min": -5, "max": 0},
    "qlu": {"distribution": "q_log_uniform", "min": 0, "max": 4, "q": 1},
    "n": {"distribution": "normal", "mu": 2, "sigma": 0.5},
    "qn": {"distribution": "q_normal", "q": 0.25},
    "ln": {"distribution": "log_normal"},
    "g": {"parameters": {"qln": {"distribution": "q_log_normal", "mu": 1, "q": 3}}},
    "fixed": {"min": 0.5, "max": 0.5},
    "inv": {"distribution": "inv_log_uniform", "min": 0, "max": 3},
    "invv": {"distribution": "inv_log_uniform_values", "min": 0.1, "max": 10},
    "be": {"distribution": "beta", "a": 2, "b": 3},
    "qbe": {"distribution": "q_beta", "q": 0.25},
    "cwp": {
        "distribution": "categorical_w_probabilities",
        "values": [1, 2, 2],
        "probabilities": [0.5, 0.25, 0.25],
    },
    "q0": {"distribution": "q_log_uniform_values", "min": 1, "max": 50, "q": 4},  # k from 0
}


def test_bayes_proposes_every_distribution_within_its_values() -> None:
    data = {"program": "t.py", "method": "bayes", "metric": {"name": "m", "goal": "maximize"}}
    data["parameters"] = EVERY_DISTRIBUTION
    s = parse_spec(data)
    history = finished(s, N_STARTUP + 4)
    for o in history:
        check_params(data, dict(o.params))
    assert history[-1].params["fixed"] == 0.5
    randomly = parse_spec({**data, "method": "random"})
    assert history[-1].params != propose(randomly, [], index=len(history) - 1, seed=0)  # TPE's


def _best(spec: Any, seed: int, metric: Any) -> float:
    """Run 30 runs one after another, each one's metric known before the next is proposed."""
    history: list[Observation] = []
    for i in range(30):
        p = propose(spec, history, index=i, seed=seed)
        assert p is not None
        history.append(Observation(p, metric(p["x"]), True))
    return min((o.params["x"] - 1.3) ** 2 for o in history)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("goal", ["minimize", "maximize"])
def test_bayes_beats_random_on_a_quadratic(goal: str) -> None:
    params = {"x": {"min": -5.0, "max": 5.0}}
    sign = 1.0 if goal == "minimize" else -1.0
    metric = lambda x: sign * (x - 1.3) ** 2  # noqa: E731
    random_median = statistics.median(
        _best(make("random", params), seed, metric) for seed in range(10)
    )
    bayes = make("bayes", params, metric={"name": "m", "goal": goal})
    for seed in range(3):
        assert _best(bayes, seed, metric) < random_median, (seed, random_median)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_=valid_spec(method="random"), seed=st.integers(0, 2**32))
def test_random_proposals_are_within_the_declared_values(spec_: dict[str, Any], seed: int) -> None:
    s = parse_spec(spec_)
    for i in range(5):
        p = propose(s, [], index=i, seed=seed)
        if s.run_cap is not None and i >= s.run_cap:
            assert p is None
        else:
            assert p is not None
            check_params(spec_, p)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_=valid_spec(method="bayes"), seed=st.integers(0, 2**32))
@example(  # found by Hypothesis: a log range 2 ulps wide made TPE propose nan
    spec_={
        "program": "train.py",
        "method": "bayes",
        "parameters": {
            "lr": {"value": None},
            "bs": {"distribution": "log_uniform_values", "min": 9.0, "max": 9.000000000000002},
        },
        "metric": {"name": "loss", "goal": "minimize"},
    },
    seed=0,
)
def test_bayes_proposals_are_within_the_declared_values(spec_: dict[str, Any], seed: int) -> None:
    spec_.pop("run_cap", None)
    s = parse_spec(spec_)
    history = finished(s, N_STARTUP + 2, seed)
    for o in history:
        check_params(spec_, dict(o.params))
    for index in (N_STARTUP, N_STARTUP + 2):  # the second one comes from TPE
        p = propose(s, history, index=index, seed=seed)
        assert p is not None
        check_params(spec_, p)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_=valid_spec(method="grid"))
def test_grid_gives_grid_size_distinct_points_then_none(spec_: dict[str, Any]) -> None:
    spec_.pop("run_cap", None)
    s = parse_spec(spec_)
    size = s.grid_size()
    assert size is not None
    points = [propose(s, [], index=i, seed=0) for i in range(size)]
    for p in points:
        assert p is not None
        check_params(spec_, p)
    assert len({canonical(p) for p in points}) == size
    assert propose(s, [], index=size, seed=0) is None


@settings(max_examples=300, deadline=None)
@given(
    low=st.integers(-50, 50) | st.floats(-50, 50).map(lambda x: round(x, 2)),
    width=st.integers(1, 20) | st.floats(0.01, 20).map(lambda x: round(x, 3)),
    q=st.sampled_from([0.05, 0.1, 0.25, 0.3, 0.5, 1, 2, 3, 1.5]),
)
def test_grid_q_uniform_is_numpys_arange_as_in_wandb(low: float, width: float, q: float) -> None:
    np = pytest.importorskip("numpy")
    high = low + width
    expected = np.arange(low, high, q).tolist()  # what W&B's grid_search.py runs
    s = make("grid", {"a": {"distribution": "q_uniform", "min": low, "max": high, "q": q}})
    got = [propose(s, [], index=i, seed=0)["a"] for i in range(len(expected))]  # type: ignore[index]
    assert s.grid_size() == len(expected)
    assert [type(v) for v in got] == [type(v) for v in expected]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)


@settings(max_examples=300, deadline=None)
@given(
    spec_=st.sampled_from(
        [
            {"distribution": "q_uniform", "min": 0.02, "max": 0.5, "q": 0.1},
            {"distribution": "q_uniform", "min": -7, "max": 9, "q": 2},
            {"distribution": "q_log_uniform_values", "min": 1, "max": 11, "q": 4},
            {"distribution": "q_log_uniform", "min": -3, "max": 2, "q": 0.5},
            {"distribution": "q_beta", "a": 0.5, "b": 0.5, "q": 0.3},
        ]
    ),
    seed=st.integers(0, 2**32),
)
def test_q_draws_are_numpys_round_of_the_draw_as_in_wandb(spec_: dict[str, Any], seed: int) -> None:
    """W&B's ppf: np.round(x / q) * q, halves to even, an integer for an integer q."""
    np = pytest.importorskip("numpy")
    s = make("random", {"a": spec_})
    param = s.parameters["a"]
    rng = random.Random(seed)
    for _ in range(20):
        x = rng.uniform(param.low, param.high)
        expected = np.round(x / spec_["q"]) * spec_["q"]
        got = param.quantize(x)
        assert got == pytest.approx(float(expected), abs=1e-12)
        assert type(got) is (int if type(spec_["q"]) is int else float)
