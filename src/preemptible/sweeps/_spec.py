"""The sweep spec: W&B's sweep configuration where the two overlap, validated in one pass.

A W&B user's spec works unchanged: the same keys, the same distributions (and the same
inference when ``distribution`` is left out: ``values`` -> categorical, ``value`` ->
constant, integer ``min``/``max`` -> int_uniform, otherwise uniform), nested ``parameters``,
the same command macros. The keys W&B documents but preemptible has no use for
(``description``, ``project``, ``entity``, ``early_terminate``, and ``target``/``impute`` in
``metric``) are accepted, kept in ``raw`` and listed in ``SweepSpec.ignored`` so the CLI can
say so; any other key is refused with the list of valid ones, because a typo that silently
does nothing (``run_caps: 10``) costs a night of compute. ``controller: {type: local}`` is
checked as W&B checks it and ignored the same way (the queue is the controller). A value
listed twice in ``values`` is drawn twice as often by random and bayes, and run once by a
grid, as in W&B.

Every problem is one ``ConfigError`` line that names the key path, e.g.
``spec.yaml: parameters.lr.distribution: 'lognormal' is not valid; valid: constant, ...``.
The input is checked to be plain JSON data first (YAML can also give dates, sets and binary),
so that ``raw`` can be stored in the queue and parsed again to the same spec by every agent.

An error never quotes a file that is not a spec: the path given may be any file (a link to
``/etc/shadow``, a key file), so until the document has parsed as a mapping a message names
only the file, the line and column, and what kind of thing was found; a parser's message is
stripped of the text it quotes. Values are quoted only from a document that is a mapping.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, NoReturn, cast

import yaml

from .._errors import ConfigError
from ._command import DEFAULT_COMMAND, macro_problem, uses_macro
from ._hyperband import early_terminate_problem

Method = Literal["grid", "random", "bayes"]
Goal = Literal["minimize", "maximize"]
METHODS: tuple[Method, ...] = ("grid", "random", "bayes")
GOALS: tuple[Goal, ...] = ("minimize", "maximize")

# distribution -> the keys it takes besides ``distribution``
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "constant": ("value",),
    "categorical": ("values", "probabilities"),
    "int_uniform": ("min", "max"),
    "uniform": ("min", "max"),
    "q_uniform": ("min", "max", "q"),
    "log_uniform_values": ("min", "max"),
    "q_log_uniform_values": ("min", "max", "q"),
    "log_uniform": ("min", "max"),
    "q_log_uniform": ("min", "max", "q"),
    "normal": ("mu", "sigma"),
    "q_normal": ("mu", "sigma", "q"),
    "log_normal": ("mu", "sigma"),
    "q_log_normal": ("mu", "sigma", "q"),
    "categorical_w_probabilities": ("values", "probabilities"),
    "inv_log_uniform": ("min", "max"),
    "inv_log_uniform_values": ("min", "max"),
    "beta": ("a", "b"),
    "q_beta": ("a", "b", "q"),
}
PARAM_KEYS = (
    *("parameters", "distribution", "value", "values", "probabilities"),
    *("min", "max", "mu", "sigma", "q", "a", "b"),
)
GRID_DISTRIBUTIONS = ("constant", "categorical", "int_uniform", "q_uniform")
LOG_SPACE = ("log_uniform", "q_log_uniform")  # min and max are natural logs of the bounds
# values whose logarithm is uniform (W&B's inverse ones are too: 1/x of a log-uniform x)
LOG_UNIFORMS = (
    *("log_uniform_values", "q_log_uniform_values", *LOG_SPACE),
    *("inv_log_uniform", "inv_log_uniform_values"),
)
NORMALS = ("normal", "q_normal", "log_normal", "q_log_normal")
BETAS = ("beta", "q_beta")
CONTROLLER_TYPES = ("local", "cloud")  # W&B's controller.type: where its sweep logic runs
PROBABILITY_TOLERANCE = 1e-8 + 1e-5  # W&B's np.isclose(sum(probabilities), 1.0)

TOP_KEYS = (
    *("program", "command", "method", "metric", "parameters", "run_cap", "name"),
    *("max_failures", "max_preemptions", "term_timeout"),
)
WANDB_IGNORED = ("description", "project", "entity", "early_terminate")
WANDB_CONTROLLER = "controller"  # accepted and ignored: this queue is the controller
METRIC_KEYS = ("name", "goal")
METRIC_IGNORED = ("target", "impute", "impute_while_running")

_ALL_TOP_KEYS = (*TOP_KEYS, *WANDB_IGNORED, WANDB_CONTROLLER)

DEFAULT_MAX_FAILURES = 0
DEFAULT_MAX_PREEMPTIONS = 100

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")  # W&B's pattern for parameter names
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.-]+")
_MAX_DEPTH = 64  # of the data as a whole
_MAX_NESTING = 16  # of nested parameter groups
_MAX_NODES = 100_000  # YAML aliases can make a small file expand to an enormous tree
_MAX_INT = 2**53  # integers beyond this are not exact as floats, which Optuna and JSON use
MAX_COUNT = 2**31 - 1  # run_cap, max_failures, max_preemptions: integer columns of the queue
MAX_GRID_RUNS = 100_000  # runs a grid sweep lays out in the queue at ``sweep create``
MAX_GRID_VALUES = 2_000_000  # parameter values those runs hold in all
MAX_SPEC_BYTES = 1 << 20  # a spec file is read up to this size, and refused beyond it
_EXACT_DIGITS = 60  # a grid size up to this many digits is named exactly, else as 10^N
_EXP_LIMIT = 700.0  # math.exp overflows above ~709.78
_Z_RANGE = 10.0  # normal draws are kept within mu +- 10 sigma (see _sample.Z_MAX)


@dataclass(frozen=True)
class Metric:
    name: str
    goal: Goal


@dataclass(frozen=True)
class ParamSpec:
    """One parameter, validated, with what sampling needs worked out once.

    ``distribution`` is one of ``DISTRIBUTIONS`` (``categorical_w_probabilities`` is kept as
    ``categorical`` with ``probabilities``), or ``"nested"`` for a group whose ``parameters``
    are its members. ``low``/``high`` bound the draws of a bounded distribution before any
    rounding (for ``log_uniform`` they are ``exp(min)``/``exp(max)``, for ``inv_log_uniform``
    ``exp(-max)``/``exp(-min)``, for the betas 0 and 1). The ``q_`` variants round a draw to
    the nearest multiple of q, ``k * q`` with ``kmin <= k <= kmax`` when bounded, and, as in
    W&B, not clamped: q_uniform from 0.05 to 0.5 with q 0.1 can give 0 and 0.5. ``q`` keeps
    its type: an integer ``q`` gives integers, as in W&B.

    In a grid, ``points`` is set for q_uniform: W&B's grid runs ``min, min + q, ...`` below
    ``max`` (numpy's ``arange(min, max, q)``), not the multiples of q a random draw gives.
    """

    distribution: str
    value: Any = None
    values: tuple[Any, ...] = ()
    probabilities: tuple[float, ...] | None = None
    min: float | None = None
    max: float | None = None
    mu: float = 0.0
    sigma: float = 1.0
    a: float = 1.0
    b: float = 1.0
    q: float | None = None
    parameters: Mapping[str, ParamSpec] | None = None
    low: float | None = None
    high: float | None = None
    kmin: int | None = None
    kmax: int | None = None
    points: int | None = None

    @property
    def size(self) -> int | None:
        """How many distinct values it can take, or None for a continuous one."""
        if self.distribution == "constant":
            return 1
        if self.distribution == "categorical":
            return len(self.values)
        if self.distribution == "int_uniform":
            return int(cast(int, self.max)) - int(cast(int, self.min)) + 1
        if self.points is not None:
            return self.points
        if self.kmin is not None and self.kmax is not None:
            return self.kmax - self.kmin + 1
        return None

    def at(self, i: int) -> Any:
        """Its ``i``-th value in grid order: values as written, integers and q_uniform's
        points ascending."""
        if self.distribution == "constant":
            return copy.deepcopy(self.value)
        if self.distribution == "categorical":
            return copy.deepcopy(self.values[i])
        if self.distribution == "int_uniform":
            return int(cast(int, self.min)) + i
        if self.points is not None:
            return self.grid_point(i)
        return self.multiple(cast(int, self.kmin) + i)

    def grid_point(self, i: int) -> float:
        """``min + i * q`` as written (0.05 + 0.1 is 0.15, where numpy says
        0.15000000000000002); an integer only when min, max and q all are, as numpy's."""
        lo, hi, q = cast(float, self.min), cast(float, self.max), cast(float, self.q)
        value = _decimal(lo) + i * _decimal(q)
        if all(isinstance(x, int) for x in (lo, hi, q)):
            return int(value)
        return float(value)

    def multiple(self, k: int) -> float:
        """``k * q`` as the user means it: 3 * 0.1 is 0.3, not 0.30000000000000004."""
        q = cast(float, self.q)
        if isinstance(q, int):
            return k * q
        return float(_decimal(q) * k)

    def quantize(self, x: float) -> float:
        """The multiple of q nearest to ``x`` (W&B's ``round(x / q) * q``, halves to even as
        numpy's), not clamped to min and max: W&B does not. ``x`` itself is first kept
        within [low, high], so ``k`` stays within [kmin, kmax]."""
        return self.multiple(round(self.clamp(x) / cast(float, self.q)))

    def clamp(self, value: float) -> float:
        """``value`` within [low, high]: exp(log(x)) and friends can land an ulp outside."""
        if self.low is None or self.high is None:
            return value
        inside = min(max(value, self.low), self.high)
        return float(inside) if isinstance(value, float) else inside


@dataclass(frozen=True)
class SweepSpec:
    """A validated sweep spec. ``raw`` is the input as plain JSON data: store it, and
    ``parse_spec(raw)`` gives this spec back on any machine.

    ``max_failures`` (default 0) is how often one run is retried after it fails or crashes:
    a run that fails with a given set of parameters usually fails again with them (a bug, a
    diverging learning rate), and W&B does not retry either, so by default its slot goes to
    the next parameters. ``max_preemptions`` (default 100) is how often one run may be
    preempted and resumed: preemptions are not the run's fault and a long run on spot
    machines can be stopped dozens of times, but a bound still ends a run that never gets
    anywhere (a node that is always reclaimed, a time limit shorter than one checkpoint).
    """

    program: str | None
    command: tuple[str, ...]
    method: Method
    metric: Metric | None
    parameters: Mapping[str, ParamSpec]
    run_cap: int | None
    max_failures: int
    max_preemptions: int
    term_timeout: float | None
    name: str | None
    raw: Mapping[str, Any]
    ignored: tuple[str, ...] = ()  # W&B keys accepted without effect, as key paths

    def grid_size(self) -> int | None:
        """The number of grid points, or None when the method is not grid."""
        if self.method != "grid":
            return None
        return self._grid_total

    @functools.cached_property
    def _grid_total(self) -> int:
        # worked out once: a grid far larger than its run_cap is a product of many numbers
        return math.prod(cast(int, param.size) for _, param in leaves(self.parameters))


def leaves(
    parameters: Mapping[str, ParamSpec], prefix: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], ParamSpec]]:
    """The parameters that take values, with their key paths, in the order written."""
    out: list[tuple[tuple[str, ...], ParamSpec]] = []
    for name, param in parameters.items():
        path = (*prefix, name)
        if param.parameters is not None:
            out.extend(leaves(param.parameters, path))
        else:
            out.append((path, param))
    return out


def load_spec(path: str | os.PathLike[str]) -> SweepSpec:
    """Read a spec from a YAML file (``yaml.safe_load``), or JSON when it ends in .json: a
    regular file of at most 1 MiB, with no key written twice in one mapping."""
    file = Path(path)
    source = _clean(str(path))
    try:
        text = _read(file, source).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory; give the spec file (YAML or JSON)") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: is not UTF-8 text; a spec is YAML or JSON") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot be read ({exc.strerror or exc})") from None
    data: object
    # keys written twice are reported once the document is known to be a spec: a key of
    # another file can be anything (the first line of /etc/shadow is one, to YAML)
    duplicates: list[tuple[object, str]] = []
    kind = "JSON" if file.suffix.lower() == ".json" else "YAML"
    if kind == "JSON":

        def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for key, value in items:
                if key in out:
                    duplicates.append((key, ""))
                out[key] = value
            return out

        try:
            data = json.loads(text, object_pairs_hook=pairs)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{source}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
            ) from None
        except (ValueError, RecursionError) as exc:
            raise ConfigError(
                f"{source}: not usable JSON: {_flat(str(exc) or 'nested too deeply')}"
            ) from None
    else:
        loader: _UniqueKeyLoader | None = None
        try:
            loader = _UniqueKeyLoader(text)  # its reader refuses control characters at once
            data = loader.get_single_data()
            duplicates = loader.duplicates
        except yaml.MarkedYAMLError as exc:
            problem = _unquoted(exc.problem or exc.context or "syntax error")
            where = _at(exc.problem_mark)
            raise ConfigError(f"{source}: not valid YAML: {problem}{where}") from None
        except yaml.reader.ReaderError as exc:  # a control character, an invalid code point
            raise ConfigError(
                f"{source}: not valid YAML: {exc.reason} (character {exc.position + 1})"
            ) from None
        except (yaml.YAMLError, ValueError) as exc:
            raise ConfigError(
                f"{source}: not valid YAML: {_unquoted(str(exc)) or 'a value it cannot read'}"
            ) from None
        except RecursionError:
            raise ConfigError(f"{source}: not valid YAML: nested too deeply") from None
        finally:
            if loader is not None:
                loader.dispose()
    if data is None:
        raise ConfigError(f"{source}: is empty; a spec needs at least method and parameters")
    if duplicates and _is_spec(data):
        key, where = duplicates[0]
        raise ConfigError(
            f"{source}: not valid {kind}: duplicate key {_short(key)}{where}; each key may appear "
            "once in a mapping"
        )
    return parse_spec(data, source=source)


def _at(mark: yaml.Mark | None) -> str:
    return "" if mark is None else f" (line {mark.line + 1}, column {mark.column + 1})"


def _read(file: Path, source: str) -> bytes:
    """The bytes of a spec file: a regular file only (a FIFO would wait for a writer forever,
    a device such as /dev/zero never ends), and at most ``MAX_SPEC_BYTES``."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        mode = os.fstat(fh.fileno()).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(file)
        if not stat.S_ISREG(mode):
            raise ConfigError(
                f"{source}: is not a regular file ({_file_kind(mode)}); give the spec file "
                "(YAML or JSON)"
            )
        data = fh.read(MAX_SPEC_BYTES + 1)
    if len(data) > MAX_SPEC_BYTES:
        raise ConfigError(
            f"{source}: is larger than 1 MiB; a spec is at most {MAX_SPEC_BYTES} bytes"
        )
    return data


def _file_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a file"


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load``, except that a key written twice in one mapping is recorded in
    ``duplicates`` (YAML says keys are unique; PyYAML keeps the last). Keys brought in by a
    merge (``<<: *base``) may still be overridden: only the keys written in the mapping itself
    are compared."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[tuple[object, str]] = []

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: SafeLoader says so itself
                    continue
                if duplicate:
                    self.duplicates.append((key, _at(key_node.start_mark)))
                seen.add(key)
        return super().construct_mapping(node, deep=deep)  # type: ignore[arg-type]


def parse_spec(data: object, *, source: str = "spec") -> SweepSpec:
    """Validate ``data`` (the loaded YAML/JSON mapping); raise ConfigError with one line."""
    try:
        return _parse(data)
    except _Invalid as exc:
        where = f"{exc.path}: " if exc.path else ""
        raise ConfigError(f"{_clean(source)}: {where}{exc.problem}") from None


class _Invalid(Exception):
    def __init__(self, path: str, problem: str) -> None:
        super().__init__(path, problem)
        self.path = path
        self.problem = problem


def _fail(path: str, problem: str) -> NoReturn:
    raise _Invalid(path, problem)


def _parse(data: object) -> SweepSpec:
    if not isinstance(data, Mapping):
        # its kind only: a file that is not a mapping is not a spec, and not to be quoted
        _fail("", f"a spec is a mapping of keys ({', '.join(TOP_KEYS)}), not {_kind(data)}")
    if not _is_spec(data):  # nor is a mapping without one key of a spec: its keys are not named
        _fail("", f"a spec is a mapping of keys ({', '.join(TOP_KEYS)}); this one has none of them")
    raw = cast(dict[str, Any], _plain(data, "", 0, [0]))
    for key in raw:
        if key not in TOP_KEYS and key not in WANDB_IGNORED and key != WANDB_CONTROLLER:
            _fail(_key(key), f"not a sweep key; valid: {', '.join(_ALL_TOP_KEYS)}")
    ignored = [key for key in WANDB_IGNORED if key in raw]
    for key in ("description", "project", "entity"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            _fail(key, f"must be text, not {_what(raw[key])}")
    if raw.get("early_terminate") is not None:  # checked here; not yet acted on (ignored)
        problem = early_terminate_problem(raw["early_terminate"])
        if problem is not None:
            _fail("", problem)  # the line names its own key path: early_terminate.eta: ...

    _controller(raw.get(WANDB_CONTROLLER), ignored)
    method = raw.get("method")
    if method is None:
        _fail("method", f"required; valid: {', '.join(METHODS)}")
    if method not in METHODS:
        _fail("method", f"{_short(method)} is not valid; valid: {', '.join(METHODS)}")
    if raw.get("parameters") is None:
        _fail("parameters", "required: the parameters to sweep, e.g. {lr: {min: 0.0001, max: 0.1}}")
    parameters = _parameters("parameters", raw["parameters"], 0)
    metric = _metric(raw.get("metric"), ignored)
    if metric is None and raw.get("early_terminate") is not None:
        _fail("metric", "required for early_terminate, e.g. {name: val_loss, goal: minimize}")
    if metric is None and method == "bayes":
        _fail("metric", "required for method bayes, e.g. {name: val_loss, goal: minimize}")
    run_cap = _count(raw, "run_cap", None, minimum=1)
    if method == "grid":
        parameters = _check_grid(parameters, "parameters", ignored)
        _check_grid_size(parameters, run_cap)

    program = raw.get("program")
    if program is not None and (not isinstance(program, str) or not program):
        _fail("program", f"must be the path of the program to run, not {_what(program)}")
    command = _command(raw.get("command"))
    if uses_macro(command, "program") and program is None:
        default = (
            ""
            if raw.get("command") is not None
            else " (the default command, ${env} ${interpreter} ${program} ${args})"
        )
        _fail("program", f"required: the command{default} uses ${{program}}")

    return SweepSpec(
        program=program,
        command=command,
        method=cast(Method, method),
        metric=metric,
        parameters=parameters,
        run_cap=run_cap,
        max_failures=cast(int, _count(raw, "max_failures", DEFAULT_MAX_FAILURES, minimum=0)),
        max_preemptions=cast(
            int, _count(raw, "max_preemptions", DEFAULT_MAX_PREEMPTIONS, minimum=0)
        ),
        term_timeout=_term_timeout(raw.get("term_timeout")),
        name=_name(raw.get("name")),
        raw=raw,
        ignored=tuple(ignored),
    )


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
        shown = "required" if kind is None else f"{_short(kind)} is not valid"
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
        _fail("metric.goal", f"{_short(goal)} is not valid; valid: {', '.join(GOALS)}")
    return Metric(name=name, goal=cast(Goal, goal))


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


def _count(raw: dict[str, Any], key: str, default: int | None, *, minimum: int) -> int | None:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_COUNT:
        _fail(key, f"{_short(value)} is not valid; use an integer from {minimum} to {MAX_COUNT}")
    return value


def _term_timeout(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        _fail("term_timeout", f"{_short(value)} is not valid; use seconds > 0, e.g. 30")
    return float(value)


def _name(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        _fail("name", f"must be text, not {_what(value)}")
    return value


def _parameters(path: str, data: object, depth: int) -> Mapping[str, ParamSpec]:
    if depth > _MAX_NESTING:
        _fail(path, f"parameters are nested more than {_MAX_NESTING} levels deep")
    if not isinstance(data, dict):
        _fail(path, f"must be a mapping of parameter names to their specs, not {_what(data)}")
    if not data:
        _fail(path, "must name at least one parameter")
    out: dict[str, ParamSpec] = {}
    for name, spec in data.items():
        where = f"{path}.{_key(name)}"
        if not _NAME.fullmatch(name):
            _fail(
                where,
                "not a valid parameter name; use letters, digits, '_', '.' and '-', "
                "starting with a letter or '_'",
            )
        out[name] = _parameter(where, spec, depth)
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
            f"{_short(dist)} is not valid; valid: {', '.join(DISTRIBUTIONS)}",
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
            _fail(f"{where}[{i}]", f"{_short(p)} is not valid; use a number >= 0")
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
        _fail(f"{path}.sigma", f"{_short(sigma)} is not valid; use a number > 0")
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
            _fail(f"{path}.{key}", f"{_short(value)} is not valid; use a number > 0")
        shape.append(float(value))
    param = ParamSpec(dist, a=shape[0], b=shape[1], low=0.0, high=1.0)
    return _quantized(path, param, data) if dist == "q_beta" else param


def _q(path: str, data: dict[str, Any]) -> float:
    q = _number(f"{path}.q", data.get("q", 1.0))  # W&B's default, a float
    if not q > 0:
        _fail(f"{path}.q", f"{_short(q)} is not valid; use a number > 0")
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


def _number(path: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = ""
        if isinstance(value, str) and _looks_like_float(value):
            hint = f" (YAML reads {value} as text; write it with a dot, e.g. 1.0e-5)"
        _fail(path, f"must be a number, not {_what(value)}{hint}")
    return value


def _looks_like_float(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _integer(path: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(path, f"must be an integer, not {_what(value)}")
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
                _fail(path or "(top level)", f"key {_short(key)} must be text (quote it in YAML)")
            where = f"{path}.{_key(key)}" if path else _key(key)
            out[key] = _plain(item, where, depth + 1, nodes)
        return out
    _fail(
        path or "(top level)",
        f"{_what(value)} is not valid here; use text (quote it in YAML), numbers, true/false, "
        "null, lists or mappings",
    )


def canonical(value: Any) -> str:
    """One text per value, so that 1, 1.0 and true count as different values, as in JSON."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _decimal(x: float) -> Decimal:
    """The number as written (its shortest repr), so 0.3 / 0.1 is exactly 3."""
    return Decimal(repr(x)) if isinstance(x, float) else Decimal(x)


def _is_spec(data: object) -> bool:
    """A mapping with at least one key of a sweep spec: a spec, maybe with mistakes, whose
    keys and values may be quoted in errors."""
    return isinstance(data, Mapping) and any(
        isinstance(key, str) and (key in TOP_KEYS or key in WANDB_IGNORED) for key in data
    )


def _kind(value: object) -> str:
    """What ``value`` is, without any of it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, str):
        return "a text"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"a {type(value).__name__}"


# A parser's message quotes what it found: 'an alias', "a tag", a character. Kept: the names
# of YAML's tokens ('<block end>') and a single character that is not a letter or a digit
# ('\t', ':'); anything else could be a piece of a file that is not a spec.
_QUOTED = re.compile(r"""\s?(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""")
_HARMLESS = re.compile(r"<[a-z ]+>|[^\w\s]|\\(?:[a-z]|x[0-9a-f]{2}|u[0-9a-f]{4})")


def _unquoted(text: str) -> str:
    def keep(match: re.Match[str]) -> str:
        quoted = match.group(0)
        return quoted if _HARMLESS.fullmatch(quoted.strip()[1:-1]) else ""

    return _flat(_QUOTED.sub(keep, text))


def _what(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"true/false ({value})"
    if isinstance(value, str):
        return f"text {_short(value)}"
    if isinstance(value, int):
        return f"integer {_short(value)}"
    if isinstance(value, float):
        return f"number {_short(value)}"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, Mapping):
        return "a mapping"
    return f"a {type(value).__name__} ({_short(value)})"


def _short(value: object, limit: int = 60) -> str:
    """A repr short enough for one line of an error message (repr escapes line breaks)."""
    try:
        shown = repr(value)
    except Exception:  # a foreign object whose repr fails must not replace the real error
        shown = f"<{type(value).__name__}>"
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _key(key: object) -> str:
    return key if isinstance(key, str) and _PLAIN_KEY.fullmatch(key) else _short(key)


def _flat(text: str) -> str:
    return " ".join(text.split())


def _clean(source: str) -> str:
    return source if source.isprintable() else _short(source)
