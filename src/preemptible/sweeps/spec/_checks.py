"""The checks of a spec as a whole: plain JSON data first, then each top-level key (method,
metric, command, counts, W&B's accepted-and-ignored keys, controller, early_terminate);
``parameters`` are checked in ``_params``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

from ..._text import short_repr
from ._command import DEFAULT_COMMAND, macro_problem, uses_macro
from ._fail import _fail, _is_spec, _key, _soft, _what, finite_number, kind_of
from ._hyperband import early_terminate_problem
from ._model import (
    CONTROLLER_TYPES,
    DEFAULT_MAX_FAILURES,
    DEFAULT_MAX_PREEMPTIONS,
    GOALS,
    MAX_COUNT,
    METHODS,
    METRIC_IGNORED,
    METRIC_KEYS,
    TOP_KEYS,
    WANDB_CONTROLLER,
    WANDB_IGNORED,
    Goal,
    Method,
    Metric,
    ParamSpec,
    SweepSpec,
)
from ._params import _check_grid, _check_grid_size, _parameters

_ALL_TOP_KEYS = (*TOP_KEYS, *WANDB_IGNORED, WANDB_CONTROLLER)
_MAX_DEPTH = 64  # of the data as a whole
_MAX_NODES = 100_000  # YAML aliases can make a small file expand to an enormous tree


def _parse(data: object) -> SweepSpec:
    if not isinstance(data, Mapping):
        # its kind only: a file that is not a mapping is not a spec, and not to be quoted
        _fail("", f"a spec is a mapping of keys ({', '.join(TOP_KEYS)}), not {kind_of(data)}")
    if not _is_spec(data):  # nor is a mapping without one key of a spec: its keys are not named
        _fail("", f"a spec is a mapping of keys ({', '.join(TOP_KEYS)}); this one has none of them")
    raw = cast(dict[str, Any], _plain(data, "", 0, [0]))
    # each key is checked on its own, so that all the problems of a file are reported at once
    # (see _fail._soft); a check that needs another key's value runs only once that is valid
    for key in raw:
        if key not in TOP_KEYS and key not in WANDB_IGNORED and key != WANDB_CONTROLLER:
            _soft(_fail, _key(key), f"not a sweep key; valid: {', '.join(_ALL_TOP_KEYS)}")
    ignored = [key for key in WANDB_IGNORED if key in raw]
    for key in ("description", "project", "entity"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            _soft(_fail, key, f"must be text, not {_what(raw[key])}")
    if raw.get("early_terminate") is not None:  # checked here; the agent's judge acts on it
        problem = early_terminate_problem(raw["early_terminate"])
        if problem is not None:
            _soft(_fail, "", problem)  # the line names its own key path: early_terminate.eta: ...

    _soft(_controller, raw.get(WANDB_CONTROLLER), ignored)
    method = _soft(_method, raw.get("method"))
    parameters = _soft(_parameters_of, raw)
    metric = _soft(_metric, raw.get("metric"), ignored)
    if raw.get("metric") is None:
        if raw.get("early_terminate") is not None:
            _soft(
                _fail,
                "metric",
                "required for early_terminate, e.g. {name: val_loss, goal: minimize}",
            )
        if method == "bayes":
            _soft(
                _fail, "metric", "required for method bayes, e.g. {name: val_loss, goal: minimize}"
            )
    run_cap = _soft(_count, raw, "run_cap", None, 1)
    if method == "grid" and parameters is not None:
        grid = _soft(_check_grid, parameters, "parameters", ignored)
        if grid is not None:
            parameters = grid
            if raw.get("run_cap") is None or run_cap is not None:  # against a valid run_cap
                _soft(_check_grid_size, grid, run_cap)

    program = raw.get("program")
    if program is not None and (not isinstance(program, str) or not program):
        _soft(_fail, "program", f"must be the path of the program to run, not {_what(program)}")
    command = _soft(_command, raw.get("command"))
    if command is not None and uses_macro(command, "program") and program is None:
        default = (
            ""
            if raw.get("command") is not None
            else " (the default command, ${env} ${interpreter} ${program} ${args})"
        )
        _soft(_fail, "program", f"required: the command{default} uses ${{program}}")
    max_failures = _soft(_count, raw, "max_failures", DEFAULT_MAX_FAILURES, 0)
    max_preemptions = _soft(_count, raw, "max_preemptions", DEFAULT_MAX_PREEMPTIONS, 0)
    term_timeout = _soft(_term_timeout, raw.get("term_timeout"))
    name = _soft(_name, raw.get("name"))

    return SweepSpec(
        program=program,
        command=cast(tuple[str, ...], command),
        method=cast(Method, method),
        metric=metric,
        parameters=cast(Mapping[str, Any], parameters),
        run_cap=run_cap,
        max_failures=cast(int, max_failures),
        max_preemptions=cast(int, max_preemptions),
        term_timeout=term_timeout,
        name=name,
        raw=raw,
        ignored=tuple(ignored),
    )


def _method(method: object) -> str:
    if method is None:
        _fail("method", f"required; valid: {', '.join(METHODS)}")
    if method not in METHODS:
        _fail("method", f"{short_repr(method)} is not valid; valid: {', '.join(METHODS)}")
    return cast(str, method)


def _parameters_of(raw: dict[str, Any]) -> Mapping[str, ParamSpec]:
    if "parameters" not in raw:
        _fail("parameters", "required: the parameters to sweep, e.g. {lr: {min: 0.0001, max: 0.1}}")
    if raw["parameters"] is None:  # the key with nothing under it (or only comments)
        _fail(
            "parameters",
            "is empty; list the parameters to sweep under it, e.g. {lr: {min: 0.0001, max: 0.1}}",
        )
    return _parameters("parameters", raw["parameters"], 0)


def _controller(data: object, ignored: list[str]) -> None:
    """W&B's ``controller: {type: local}`` (its sweep logic on the user's machine, or
    ``cloud``, on W&B's servers): here the queue is the controller, so it is checked as W&B
    checks it and ignored."""
    if data is None:
        return
    if not isinstance(data, dict):
        _fail(
            WANDB_CONTROLLER,
            f"must be a mapping such as {{type: local}}, not {_what(data)}",
        )
    for key in data:
        if key != "type":
            _fail(f"{WANDB_CONTROLLER}.{_key(key)}", "not a controller key; valid: type")
    kind = data.get("type")
    if kind not in CONTROLLER_TYPES:
        shown = "required" if kind is None else f"{short_repr(kind)} is not valid"
        _fail(f"{WANDB_CONTROLLER}.type", f"{shown}; valid: {', '.join(CONTROLLER_TYPES)}")
    ignored.append(WANDB_CONTROLLER)


def _metric(data: object, ignored: list[str]) -> Metric | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        _fail(
            "metric",
            f"must be a mapping such as {{name: val_loss, goal: minimize}}, not {_what(data)}",
        )
    for key in data:
        if key not in METRIC_KEYS and key not in METRIC_IGNORED:
            _fail(
                f"metric.{_key(key)}",
                f"not a metric key; valid: {', '.join(METRIC_KEYS + METRIC_IGNORED)}",
            )
    ignored.extend(f"metric.{key}" for key in METRIC_IGNORED if key in data)
    name = data.get("name")
    if not isinstance(name, str) or not name:
        _fail(
            "metric.name",
            f"required: the name of the metric the program reports, not {_what(name)}",
        )
    goal = data.get("goal", "minimize")
    if goal not in GOALS:
        _fail("metric.goal", f"{short_repr(goal)} is not valid; valid: {', '.join(GOALS)}")
    target = data.get("target")
    if target is not None and not finite_number(target):
        _fail(
            "metric.target",
            f"must be a finite number (the value that ends the sweep), not {_what(target)}",
        )
    return Metric(name=name, goal=cast(Goal, goal), target=target)


def _command(data: object) -> tuple[str, ...]:
    if data is None:
        return DEFAULT_COMMAND
    if not isinstance(data, list):
        _fail(
            "command",
            f"must be a list of arguments (it runs without a shell), e.g. "
            f"[{', '.join(DEFAULT_COMMAND)}], not {_what(data)}",
        )
    if not data:
        _fail("command", f"must not be empty; the default is [{', '.join(DEFAULT_COMMAND)}]")
    out = []
    for i, element in enumerate(data):
        if isinstance(element, bool) or not isinstance(element, (str, int, float)):
            _fail(f"command[{i}]", f"must be text (quote it in YAML), not {_what(element)}")
        text = str(element)
        problem = macro_problem(text)
        if problem is not None:
            _fail(f"command[{i}]", problem)
        out.append(text)
    return tuple(out)


def _count(raw: dict[str, Any], key: str, default: int | None, minimum: int) -> int | None:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_COUNT:
        _fail(
            key, f"{short_repr(value)} is not valid; use an integer from {minimum} to {MAX_COUNT}"
        )
    return value


def _term_timeout(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        _fail("term_timeout", f"{short_repr(value)} is not valid; use seconds > 0, e.g. 30")
    return float(value)


def _name(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        _fail("name", f"must be text, not {_what(value)}")
    return value


def _plain(value: object, path: str, depth: int, nodes: list[int]) -> Any:
    """A copy of ``value`` as JSON data (dict, list, str, int, finite float, bool, None)."""
    nodes[0] += 1
    if nodes[0] > _MAX_NODES:
        _fail(path, f"the spec is too large (more than {_MAX_NODES} values)")
    if depth > _MAX_DEPTH:
        _fail(path, f"nested more than {_MAX_DEPTH} levels deep")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if "\x00" in value:
            _fail(path, "contains a NUL character")
        return value
    if isinstance(value, int):
        try:
            float(value)
        except OverflowError:
            _fail(path, "is too large a number")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            _fail(path, f"{value!r} is not valid; use a finite number")
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{path}[{i}]", depth + 1, nodes) for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                _fail(
                    path or "(top level)", f"key {short_repr(key)} must be text (quote it in YAML)"
                )
            where = f"{path}.{_key(key)}" if path else _key(key)
            out[key] = _plain(item, where, depth + 1, nodes)
        return out
    _fail(
        path or "(top level)",
        f"{_what(value)} is not valid here; use text (quote it in YAML), numbers, true/false, "
        "null, lists or mappings",
    )
