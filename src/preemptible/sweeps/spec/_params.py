"""The checks of a spec's ``parameters``: each distribution's keys and bounds, and what a
grid runs (each value once, q_uniform's points, a size it can lay out in the queue)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any, cast

from ..._text import short_repr
from ._fail import _fail, _integer, _key, _number, _soft, _warn, _what
from ._model import (
    BETAS,
    DISTRIBUTIONS,
    GRID_DISTRIBUTIONS,
    LOG_SPACE,
    MAX_GRID_RUNS,
    MAX_GRID_VALUES,
    NORMALS,
    PARAM_KEYS,
    PROBABILITY_TOLERANCE,
    ParamSpec,
    canonical,
    leaves,
)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")  # W&B's pattern for parameter names
_MAX_NESTING = 16  # of nested parameter groups
_MAX_INT = 2**53  # integers beyond this are not exact as floats, which Optuna and JSON use
_EXACT_DIGITS = 60  # a grid size up to this many digits is named exactly, else as 10^N
# the natural-log forms W&B deprecates, and what it says to use instead
_DEPRECATED = {
    "log_uniform": "log_uniform_values",
    "q_log_uniform": "q_log_uniform_values",
    "inv_log_uniform": "inv_log_uniform_values",
}
_EXP_LIMIT = 700.0  # math.exp overflows above ~709.78
_Z_RANGE = 10.0  # normal draws are kept within mu +- 10 sigma (see _sample.Z_MAX)


def _parameters(path: str, data: object, depth: int) -> Mapping[str, ParamSpec]:
    if depth > _MAX_NESTING:
        _fail(path, f"parameters are nested more than {_MAX_NESTING} levels deep")
    if not isinstance(data, dict):
        _fail(path, f"must be a mapping of parameter names to their specs, not {_what(data)}")
    if not data:
        _fail(path, "must name at least one parameter")
    out: dict[str, ParamSpec] = {}
    for name, spec in data.items():  # each on its own: all their problems are reported
        where = f"{path}.{_key(name)}"
        if not _NAME.fullmatch(name):
            _soft(
                _fail,
                where,
                "not a valid parameter name; use letters, digits, '_', '.' and '-', "
                "starting with a letter or '_'",
            )
            continue
        param = _soft(_parameter, where, spec, depth)
        if param is not None:
            out[name] = param
    return MappingProxyType(out)


def _parameter(path: str, data: object, depth: int) -> ParamSpec:
    if not isinstance(data, dict):
        _fail(
            path,
            "must be a mapping such as {values: [1, 2]}, {min: 0, max: 1} or {value: 3}, "
            f"not {_what(data)}",
        )
    for key in data:
        if key not in PARAM_KEYS:
            _fail(f"{path}.{_key(key)}", f"not a parameter key; valid: {', '.join(PARAM_KEYS)}")
    if "parameters" in data:
        for key in data:
            if key != "parameters":
                _fail(
                    f"{path}.{key}", "not valid beside 'parameters' (a nested group has only those)"
                )
        nested = _parameters(f"{path}.parameters", data["parameters"], depth + 1)
        return ParamSpec("nested", parameters=nested)

    dist = data.get("distribution")
    if "distribution" not in data:
        dist = _infer(path, data)
    elif not isinstance(dist, str) or dist not in DISTRIBUTIONS:
        _fail(
            f"{path}.distribution",
            f"{short_repr(dist)} is not valid; valid: {', '.join(DISTRIBUTIONS)}",
        )
    if dist in _DEPRECATED:  # W&B's words (its sweeps' config/schema.py)
        _warn(
            path,
            f"uses {dist}, where min/max specify base-e exponents. Use {_DEPRECATED[dist]} to "
            "specify limit values.",
        )
    keys = DISTRIBUTIONS[dist]
    for key in data:
        if key != "distribution" and key not in keys:
            _fail(
                f"{path}.{key}",
                f"not valid with distribution {dist}; valid keys: distribution, {', '.join(keys)}",
            )
    if dist == "constant":
        if "value" not in data:
            _fail(f"{path}.value", "required for distribution constant")
        return ParamSpec(dist, value=data["value"])
    if dist in ("categorical", "categorical_w_probabilities"):
        if dist == "categorical_w_probabilities" and "probabilities" not in data:
            _fail(
                f"{path}.probabilities",
                "required for distribution categorical_w_probabilities: one number >= 0 per "
                "value, adding up to 1",
            )
        return _categorical(path, data)
    if dist in NORMALS:
        return _normal(path, dist, data)
    if dist in BETAS:
        return _beta(path, dist, data)
    return _bounded(path, dist, data)


def _infer(path: str, data: dict[str, Any]) -> str:
    """W&B's rules for a parameter without ``distribution``."""
    if "value" in data:
        return "constant"
    if "values" in data:
        return "categorical"
    if "min" in data or "max" in data:
        ints = [
            isinstance(data.get(k), int) and not isinstance(data.get(k), bool)
            for k in ("min", "max")
        ]
        return "int_uniform" if all(ints) else "uniform"
    _fail(path, "give values, value, min and max, a distribution, or nested parameters")


def _categorical(path: str, data: dict[str, Any]) -> ParamSpec:
    values = data.get("values")
    if not isinstance(values, list) or not values:
        _fail(
            f"{path}.values", f"must be a non-empty list of the values to try, not {_what(values)}"
        )
    # a value written twice is drawn twice as often, as in W&B (a grid runs it once)
    probabilities = data.get("probabilities")
    if probabilities is None:
        return ParamSpec("categorical", values=tuple(values))
    where = f"{path}.probabilities"
    if not isinstance(probabilities, list) or len(probabilities) != len(values):
        _fail(
            where,
            f"must be a list of {len(values)} numbers, one per value, not {_what(probabilities)}",
        )
    for i, p in enumerate(probabilities):
        if isinstance(p, bool) or not isinstance(p, (int, float)) or p < 0:
            _fail(f"{where}[{i}]", f"{short_repr(p)} is not valid; use a number >= 0")
    total = math.fsum(probabilities)
    if abs(total - 1.0) > PROBABILITY_TOLERANCE:
        _fail(where, f"must add up to 1 (within {PROBABILITY_TOLERANCE:.0e}), not {total:g}")
    return ParamSpec(
        "categorical", values=tuple(values), probabilities=tuple(map(float, probabilities))
    )


def _normal(path: str, dist: str, data: dict[str, Any]) -> ParamSpec:
    mu = _number(f"{path}.mu", data.get("mu", 0.0))
    sigma = _number(f"{path}.sigma", data.get("sigma", 1.0))
    if not sigma > 0:
        _fail(f"{path}.sigma", f"{short_repr(sigma)} is not valid; use a number > 0")
    q = _q(path, data) if dist.startswith("q_") else None
    if dist in ("log_normal", "q_log_normal"):
        if mu + _Z_RANGE * sigma > _EXP_LIMIT:
            _fail(
                path,
                f"mu + {_Z_RANGE:g} * sigma must be <= {_EXP_LIMIT:g} "
                "(the values are exp() of a normal draw)",
            )
        extreme = math.exp(mu + _Z_RANGE * sigma)
    else:
        extreme = abs(mu) + _Z_RANGE * sigma
    if not math.isfinite(extreme) or (q is not None and not math.isfinite(extreme / q)):
        _fail(path, "mu and sigma are too large for floating point")
    return ParamSpec(dist, mu=mu, sigma=sigma, q=q)


def _bounded(path: str, dist: str, data: dict[str, Any]) -> ParamSpec:
    for key in ("min", "max"):
        if key not in data:
            _fail(f"{path}.{key}", f"required for distribution {dist}")
    lo: float
    hi: float
    if dist == "int_uniform":
        lo, hi = (_integer(f"{path}.{k}", data[k]) for k in ("min", "max"))
        if max(abs(lo), abs(hi)) > _MAX_INT:
            _fail(path, f"min and max of int_uniform must be within +-2**53 ({_MAX_INT})")
    else:
        lo, hi = (_number(f"{path}.{k}", data[k]) for k in ("min", "max"))
    if lo > hi:
        _fail(f"{path}.min", f"{lo!r} is greater than max ({hi!r})")
    values = ("log_uniform_values", "q_log_uniform_values", "inv_log_uniform_values")
    if dist in values and not lo > 0:
        _fail(f"{path}.min", f"{lo!r} is not valid for {dist}; use a number > 0")
    low, high = lo, hi
    if dist in (*LOG_SPACE, "inv_log_uniform"):
        if lo < -_EXP_LIMIT or hi > _EXP_LIMIT:
            _fail(
                path, f"min and max of {dist} are natural logs; keep them within +-{_EXP_LIMIT:g}"
            )
        if dist == "inv_log_uniform":  # 1/x is log-uniform from exp(min) to exp(max)
            low, high = math.exp(-hi), math.exp(-lo)
        else:
            low, high = math.exp(lo), math.exp(hi)
    if not math.isfinite(float(high) - float(low)):
        _fail(path, "max - min is too large for floating point")
    if not dist.startswith("q_"):
        return ParamSpec(dist, min=lo, max=hi, low=low, high=high)
    return _quantized(path, ParamSpec(dist, min=lo, max=hi, low=low, high=high), data)


def _quantized(path: str, param: ParamSpec, data: dict[str, Any]) -> ParamSpec:
    """``param`` with its q, and the multipliers k of q that rounding a draw can give."""
    q = _q(path, data)
    low, high = cast(float, param.low), cast(float, param.high)
    if not max(abs(low / q), abs(high / q)) <= _MAX_INT:
        _fail(f"{path}.q", f"{q!r} is too small for min and max (more than 2**53 steps)")
    # the same float arithmetic as quantize(), which is monotonic in the draw
    kmin, kmax = round(low / q), round(high / q)
    return replace(param, q=q, kmin=kmin, kmax=kmax)


def _beta(path: str, dist: str, data: dict[str, Any]) -> ParamSpec:
    shape = []
    for key in ("a", "b"):
        value = _number(f"{path}.{key}", data.get(key, 1.0))  # W&B's defaults
        if not value > 0:
            _fail(f"{path}.{key}", f"{short_repr(value)} is not valid; use a number > 0")
        shape.append(float(value))
    param = ParamSpec(dist, a=shape[0], b=shape[1], low=0.0, high=1.0)
    return _quantized(path, param, data) if dist == "q_beta" else param


def _q(path: str, data: dict[str, Any]) -> float:
    q = _number(f"{path}.q", data.get("q", 1.0))  # W&B's default, a float
    if not q > 0:
        _fail(f"{path}.q", f"{short_repr(q)} is not valid; use a number > 0")
    return q


def _check_grid(
    parameters: Mapping[str, ParamSpec], path: str, ignored: list[str]
) -> Mapping[str, ParamSpec]:
    """The parameters as a grid runs them, as W&B's grid does: each of the equal values of a
    list once (the first; the others are listed in ``ignored``), q_uniform as
    ``min, min + q, ...`` below max."""
    out: dict[str, ParamSpec] = {}
    for name, param in parameters.items():
        where = f"{path}.{name}"
        if param.parameters is not None:
            nested = _check_grid(param.parameters, f"{where}.parameters", ignored)
            out[name] = replace(param, parameters=nested)
            continue
        if param.distribution not in GRID_DISTRIBUTIONS:
            _fail(
                where,
                f"distribution {param.distribution} has no finite set of values for method "
                "grid; use values, value, int_uniform or q_uniform (or method random/bayes)",
            )
        elif param.probabilities is not None:
            _fail(
                f"{where}.probabilities", "not valid with method grid, which runs every value once"
            )
        if param.distribution == "categorical":
            param = _distinct(param, where, ignored)
        elif param.distribution == "q_uniform":
            param = _grid_points(param, where)
        out[name] = param
    return MappingProxyType(out)


def grid_key(value: Any) -> str:
    """Values a grid runs once: W&B compares the YAML of each value, with a float that is
    a whole number taken as the integer (so 1 and 1.0 are one value, true another)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return canonical(value)


def _distinct(param: ParamSpec, where: str, ignored: list[str]) -> ParamSpec:
    seen: set[str] = set()
    kept = []
    for i, value in enumerate(param.values):
        key = grid_key(value)
        if key in seen:
            ignored.append(f"{where}.values[{i}]")
        else:
            seen.add(key)
            kept.append(value)
    return param if len(kept) == len(param.values) else replace(param, values=tuple(kept))


def _grid_points(param: ParamSpec, where: str) -> ParamSpec:
    lo, hi, q = cast(float, param.min), cast(float, param.max), cast(float, param.q)
    points = math.ceil((hi - lo) / q)  # the length of numpy's arange(min, max, q)
    if points < 1:
        _fail(
            where,
            f"q_uniform in a grid runs min, min + q, ... below max, and min ({lo!r}) is not "
            f"below max ({hi!r}); use a larger max, or value: {lo!r}",
        )
    return replace(param, points=points)


def _check_grid_size(parameters: Mapping[str, ParamSpec], run_cap: int | None) -> None:
    """A grid is laid out in the queue when the sweep is created, a run per point (up to
    run_cap): refuse one too large to lay out before anything is built."""
    found = leaves(parameters)
    exact: int | None = 1  # the number of points, while it has at most _EXACT_DIGITS digits
    log10 = 0.0
    for _, param in found:
        size = cast(int, param.size)
        log10 += math.log10(size)
        if exact is not None:
            exact *= size
            if exact >= 10**_EXACT_DIGITS:
                exact = None  # an astronomic grid: not worth multiplying out
    runs = exact
    if run_cap is not None and (runs is None or run_cap < runs):
        runs = run_cap
    if runs is None or runs > MAX_GRID_RUNS:
        shown = f"{exact:,}" if exact is not None else f"about 10^{math.floor(log10)}"
        _fail(
            "parameters",
            f"the grid has {shown} points, more than the {MAX_GRID_RUNS:,} runs a grid sweep "
            f"may have; use fewer values, a run_cap of at most {MAX_GRID_RUNS:,}, or method "
            "random",
        )
    per_run = sum(_weight(param) for _, param in found)
    if runs * per_run > MAX_GRID_VALUES:
        _fail(
            "parameters",
            f"the grid's {runs:,} runs would hold {runs * per_run:,} parameter values in all, "
            f"more than the {MAX_GRID_VALUES:,} a grid sweep may have; use fewer runs or fewer "
            "parameters",
        )


def _weight(param: ParamSpec) -> int:
    """How many JSON values one run's value of ``param`` holds, at most."""
    if param.distribution == "constant":
        return _nodes(param.value)
    if param.distribution == "categorical":
        return max(_nodes(v) for v in param.values)
    return 1


def _nodes(value: object) -> int:
    if isinstance(value, list):
        return 1 + sum(_nodes(v) for v in value)
    if isinstance(value, dict):
        return 1 + sum(_nodes(v) for v in value.values())
    return 1
