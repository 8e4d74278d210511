"""The sweep spec's model: the validated spec (``SweepSpec``, ``ParamSpec``, ``Metric``) and
the constants that say what a spec may hold. ``_spec`` reads and checks one; see there."""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal, cast

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
    *("max_failures", "max_preemptions", "term_timeout", "early_terminate"),
)
WANDB_IGNORED = ("description", "project", "entity")
WANDB_CONTROLLER = "controller"  # accepted and ignored: this queue is the controller
METRIC_KEYS = ("name", "goal", "target")
METRIC_IGNORED = ("impute", "impute_while_running")


DEFAULT_MAX_FAILURES = 0
DEFAULT_MAX_PREEMPTIONS = 100

MAX_COUNT = 2**31 - 1  # run_cap, max_failures, max_preemptions: integer columns of the queue
MAX_GRID_RUNS = 100_000  # runs a grid sweep lays out in the queue at ``sweep create``
MAX_GRID_VALUES = 2_000_000  # parameter values those runs hold in all
MAX_SPEC_BYTES = 1 << 20  # a spec file is read up to this size, and refused beyond it


@dataclass(frozen=True)
class Metric:
    name: str
    goal: Goal
    target: float | None = None  # a run reporting this or better ends the sweep (no new runs)

    def reached(self, value: float | None) -> bool:
        """Whether ``value`` is at or beyond the target (<= for minimize, >= for maximize)."""
        if self.target is None or value is None:
            return False
        return value <= self.target if self.goal == "minimize" else value >= self.target


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
    # what was accepted but is doubtful (a deprecated form, a number YAML read as text), one
    # line each naming its key path; not part of the spec itself, so not compared
    warnings: tuple[str, ...] = field(default=(), compare=False)

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


def canonical(value: Any) -> str:
    """One text per value, so that 1, 1.0 and true count as different values, as in JSON."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _decimal(x: float) -> Decimal:
    """The number as written (its shortest repr), so 0.3 / 0.1 is exactly 3."""
    return Decimal(repr(x)) if isinstance(x, float) else Decimal(x)
