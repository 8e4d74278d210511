"""Hypothesis strategies for sweep specs, and an independent check of a proposed value.

``valid_spec`` draws specs a W&B user could write (every distribution, nested groups, the
optional keys); ``garbage`` draws anything YAML or a Python caller could hand to parse_spec.
``check_value`` re-derives from the raw parameter what values it may take, without the code
under test, so a sampler bug cannot hide behind the parser's own numbers.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import strategies as st

METHODS = ("grid", "random", "bayes")
GRID_KINDS = ("constant", "categorical", "int_uniform", "q_uniform")
ALL_KINDS = (
    *GRID_KINDS,
    "uniform",
    "log_uniform_values",
    "q_log_uniform_values",
    "log_uniform",
    "q_log_uniform",
    "normal",
    "q_normal",
    "log_normal",
    "q_log_normal",
    "categorical_w_probabilities",
    "inv_log_uniform",
    "inv_log_uniform_values",
    "beta",
    "q_beta",
)
VOCABULARY = (
    *("program", "command", "method", "metric", "parameters", "run_cap", "name"),
    *("max_failures", "max_preemptions", "term_timeout", "description", "early_terminate"),
    *("distribution", "value", "values", "probabilities", "min", "max", "mu", "sigma", "q"),
    *("a", "b", "controller", "type", "local", "${args_no_equals}", "${args_override_hydra}"),
    *("goal", "minimize", "maximize", "target", *METHODS, *ALL_KINDS),
    *("${args}", "${program}", "${env}", "${args_json_file}", "--x=${args}", "${nope}"),
)


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


TEXT = st.text(st.characters(exclude_characters="\x00"), max_size=6)  # NUL cannot be in argv
NAMES = st.sampled_from(["lr", "bs", "opt", "a.b", "x-1", "_y", "Z9", "momentum", "beta"])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(-1e6, 1e6, allow_nan=False)
    | TEXT
)
VALUES = SCALARS | st.lists(SCALARS, max_size=2) | st.dictionaries(NAMES, SCALARS, max_size=2)
QS = st.sampled_from([0.1, 0.25, 0.5, 1.0, 1, 2, 3])
SMALL = st.floats(0.01, 5.0)


@st.composite
def leaf(draw: st.DrawFn, *, grid: bool = False) -> dict[str, Any]:
    """One valid parameter; ``distribution`` is sometimes left to W&B's inference."""
    kind = draw(st.sampled_from(GRID_KINDS if grid else ALL_KINDS))
    explicit = draw(st.booleans())
    out: dict[str, Any] = {"distribution": kind} if explicit else {}
    if kind == "constant":
        out["value"] = draw(VALUES)
    elif kind in ("categorical", "categorical_w_probabilities"):
        # values may repeat: weights to random and bayes, run once by a grid, as in W&B
        values = draw(st.lists(VALUES, min_size=1, max_size=4))
        out["values"] = values
        if kind == "categorical_w_probabilities" or (not grid and draw(st.booleans())):
            weights = draw(st.lists(st.integers(0, 5), min_size=len(values), max_size=len(values)))
            weights[0] += 1 if sum(weights) == 0 else 0
            out["probabilities"] = [w / sum(weights) for w in weights]
            if kind == "categorical_w_probabilities":
                out["distribution"] = kind
    elif kind == "int_uniform":
        low = draw(st.integers(-1000, 1000))
        out.update(min=low, max=low + draw(st.integers(0, 4 if grid else 10**6)))
    elif kind == "uniform":
        low = draw(st.floats(-1e6, 1e6))
        out.update(min=low, max=low + draw(st.floats(0.0, 1e6)))  # floats: inferred uniform
    elif kind == "q_uniform":
        q = draw(QS)
        low = draw(st.floats(-100, 100))
        out.update(distribution=kind, q=q, min=low, max=low + q * draw(st.floats(1.0, 4.0)))
    elif kind == "log_uniform_values":
        low = draw(st.floats(1e-6, 1e3))
        out.update(distribution=kind, min=low, max=low * draw(st.floats(1.0, 1e3)))
    elif kind == "q_log_uniform_values":
        q = draw(QS)
        low = draw(st.floats(0.01, 100))
        out.update(distribution=kind, q=q, min=low, max=low + q * draw(st.floats(1.0, 50.0)))
    elif kind == "log_uniform":
        low = draw(st.floats(-20, 10))
        out.update(distribution=kind, min=low, max=low + draw(st.floats(0.0, 10.0)))
    elif kind == "q_log_uniform":
        q = draw(QS)
        low = draw(st.floats(-2, 3))
        high = math.log(math.exp(low) + q * draw(st.floats(1.0, 20.0)))
        out.update(distribution=kind, q=q, min=low, max=high)
    elif kind == "inv_log_uniform":
        low = draw(st.floats(-10, 20))
        out.update(distribution=kind, min=low, max=low + draw(st.floats(0.0, 10.0)))
    elif kind == "inv_log_uniform_values":
        low = draw(st.floats(1e-6, 1e3))
        out.update(distribution=kind, min=low, max=low * draw(st.floats(1.0, 1e3)))
    elif kind in ("beta", "q_beta"):
        out["distribution"] = kind
        for key in ("a", "b"):
            if draw(st.booleans()):
                out[key] = draw(st.floats(0.05, 50.0) | st.integers(1, 20))
        if kind == "q_beta" and draw(st.booleans()):
            out["q"] = draw(QS)
    else:  # the normals
        out["distribution"] = kind
        if draw(st.booleans()):
            out.update(mu=draw(st.floats(-10, 10)), sigma=draw(SMALL))
        if kind.startswith("q_"):
            out["q"] = draw(QS)
    return out


@st.composite
def parameters(draw: st.DrawFn, *, grid: bool = False) -> dict[str, Any]:
    member = leaf(grid=grid)
    group = st.dictionaries(NAMES, member, min_size=1, max_size=2).map(lambda p: {"parameters": p})
    return draw(st.dictionaries(NAMES, member | group, min_size=1, max_size=3 if grid else 4))


@st.composite
def valid_spec(draw: st.DrawFn, method: str | None = None) -> dict[str, Any]:
    method = method or draw(st.sampled_from(METHODS))
    spec: dict[str, Any] = {
        "program": "train.py",
        "method": method,
        "parameters": draw(parameters(grid=method == "grid")),
    }
    if method == "bayes" or draw(st.booleans()):
        spec["metric"] = {"name": "loss", "goal": draw(st.sampled_from(["minimize", "maximize"]))}
    optional = {
        "run_cap": st.integers(1, 1000),
        "max_failures": st.integers(0, 5),
        "max_preemptions": st.integers(0, 500),
        "term_timeout": st.floats(0.5, 600) | st.integers(1, 600),
        "name": TEXT,
        "description": TEXT,
        "command": st.sampled_from(
            [
                ["${env}", "${interpreter}", "${program}", "${args}"],
                ["python", "${program}", "--cfg=${args_json_file}"],
                ["${interpreter}", "-m", "pkg.train", "${args_no_hyphens}", "${args_json}"],
            ]
        ),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            spec[key] = draw(strategy)
    return spec


ODD = (
    st.dates()
    | st.datetimes()
    | st.binary(max_size=4)
    | st.just(float("nan"))
    | st.just(float("inf"))
    | st.just(10**400)
    | st.just(-(10**400))
    | st.just(1e-320)
    | st.just(1e308)
    | st.just(-1e308)
    | st.frozensets(st.integers(), max_size=2)
    | st.text(alphabet="\x00\n\r\u2028${}", max_size=6)
)
LEAVES = SCALARS | st.integers() | st.floats() | st.sampled_from(VOCABULARY) | ODD
KEYS = st.sampled_from(VOCABULARY) | st.text(max_size=4) | st.integers(-2, 2) | st.none()
garbage = st.recursive(
    LEAVES,
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(KEYS, children, max_size=5)
    ),
    max_leaves=30,
)
# shaped like a spec, so that the parser gets past its first checks
param_like = st.dictionaries(st.sampled_from(VOCABULARY) | KEYS, garbage, max_size=4)
spec_like = st.fixed_dictionaries(
    {},
    optional={
        "method": st.sampled_from(METHODS) | garbage,
        "program": st.just("train.py") | garbage,
        "parameters": st.dictionaries(NAMES | KEYS, param_like | garbage, max_size=4) | garbage,
        "metric": st.fixed_dictionaries({"name": st.just("loss") | garbage}) | garbage,
        "command": st.lists(st.sampled_from(VOCABULARY) | garbage, max_size=4) | garbage,
        "run_cap": garbage,
        "term_timeout": garbage,
        "max_failures": garbage,
        "early_terminate": garbage,
    },
)


def check_value(param: dict[str, Any], value: Any, *, grid: bool = False) -> None:
    """Assert that ``value`` is one the raw parameter spec ``param`` allows (in a grid when
    ``grid``)."""
    if "parameters" in param:
        assert isinstance(value, dict) and list(value) == list(param["parameters"]), value
        for name, member in param["parameters"].items():
            check_value(member, value[name], grid=grid)
        return
    kind = param.get("distribution") or _inferred(param)
    if kind == "constant":
        assert canonical(value) == canonical(param["value"])
    elif kind in ("categorical", "categorical_w_probabilities"):
        assert canonical(value) in {canonical(v) for v in param["values"]}
    elif kind == "q_uniform" and grid:  # W&B's arange(min, max, q)
        low, q = param["min"], param.get("q", 1.0)
        k = round((value - low) / q)
        assert k >= 0 and abs(low + k * q - value) <= 1e-9 * max(1.0, abs(value)), (param, value)
        assert value < param["max"] or math.isclose(value, param["max"]), (param, value)
        assert (type(value) is int) == all(type(param[k]) is int for k in ("min", "max", "q"))
    elif kind == "int_uniform":
        assert type(value) is int and param["min"] <= value <= param["max"]
    elif kind in ("normal", "q_normal", "log_normal", "q_log_normal"):
        assert isinstance(value, (int, float)) and math.isfinite(value)
        if kind.startswith("q_log") or kind == "log_normal":
            assert value >= 0
        if kind.startswith("q_"):
            _check_multiple(param["q"], value)
    else:
        low, high = (0.0, 1.0) if kind in ("beta", "q_beta") else (param["min"], param["max"])
        if kind in ("log_uniform", "q_log_uniform"):
            low, high = math.exp(low) * (1 - 1e-12), math.exp(high) * (1 + 1e-12)
        elif kind == "inv_log_uniform":
            low, high = math.exp(-high) * (1 - 1e-12), math.exp(-low) * (1 + 1e-12)
        elif kind == "inv_log_uniform_values":
            low, high = low * (1 - 1e-12), high * (1 + 1e-12)
        assert isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind.startswith("q_"):  # W&B's round(x / q) * q, not clamped to min and max
            q = param.get("q", 1.0)
            _check_multiple(q, value)
            low, high = round(low / q) * q, round(high / q) * q
            low, high = low - 1e-9 * abs(low), high + 1e-9 * abs(high)
        assert low <= value <= high, (low, value, high)


def check_params(spec: dict[str, Any], params: dict[str, Any]) -> None:
    check_value({"parameters": spec["parameters"]}, params, grid=spec["method"] == "grid")


def _check_multiple(q: float, value: float) -> None:
    assert (type(value) is int) == (type(q) is int), (q, value)
    ratio = value / q
    assert abs(ratio - round(ratio)) <= 1e-9 * max(1.0, abs(ratio)), (q, value)


def _inferred(param: dict[str, Any]) -> str:
    if "value" in param:
        return "constant"
    if "values" in param:
        return "categorical"
    ints = all(type(param[k]) is int for k in ("min", "max"))
    return "int_uniform" if ints else "uniform"
