"""The parameters of run number ``index`` of a sweep: grid, random, or bayes (Optuna's TPE).

``propose`` is a pure function of (spec, history, index, seed), so that any number of agents
computing it for the same run agree without talking to each other; the queue only has to
hand each index out once.

- grid: index -> point like nested for-loops over the parameters in alphabetical order of
  their key paths (the last one varies fastest), each over its values in the order written
  (int_uniform ascending, q_uniform as W&B's ``min, min + q, ...`` below max; equal values
  run once, see ``_spec.grid_key``). None after the last point.
- random: each parameter is drawn from ``random.Random(f"{seed}:{index}:{path}")``, so a
  parameter's value does not change when another parameter is added or removed. Each
  distribution is W&B's: a value written twice in ``values`` is drawn twice as often, and the
  ``q_`` variants are ``round(x / q) * q``, not clamped to min and max.
- bayes: as random until ``N_STARTUP`` runs have finished with a metric; then every such run
  is added to an in-memory Optuna study (sorted, so the order the history comes in does not
  matter) and a TPE sampler seeded with (seed, index) proposes the next point. The normals
  are searched through their CDF, which keeps their prior; a beta over its support, 0 to 1.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, cast

from ..._errors import ConfigError
from ._fail import finite_number
from ._model import BETAS, LOG_UNIFORMS, NORMALS, ParamSpec, SweepSpec, canonical, leaves

N_STARTUP = 8  # finished runs before TPE takes over (Optuna's own default is 10)
Z_MAX = 8.0  # normal draws are kept within mu +- Z_MAX sigma (the spec checks 10 sigma)
U_MIN = 1e-15  # bayes searches normals in CDF space, (U_MIN, 1 - U_MIN)
_MISSING = object()


@dataclass(frozen=True)
class Observation:
    """A run of the sweep as far as the sampler cares: its parameters, its metric (None if
    it reported none), and whether it has finished."""

    params: Mapping[str, Any]
    metric: float | None
    finished: bool


def propose(
    spec: SweepSpec, history: Sequence[Observation], *, index: int, seed: int
) -> dict[str, Any] | None:
    """The parameters of run ``index`` (0-based), nested like the spec, or None when the
    method has nothing left (grid exhausted, or ``run_cap`` reached)."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ConfigError(f"index={index!r} is not valid; use an integer >= 0")
    if spec.run_cap is not None and index >= spec.run_cap:
        return None
    if spec.method == "grid":
        return _grid(spec, index)
    values = _random(spec, index, seed)
    if spec.method == "bayes":
        values.update(_bayes(spec, history, index, seed))
    return _nest(spec.parameters, values)


def _grid(spec: SweepSpec, index: int) -> dict[str, Any] | None:
    params = leaves(spec.parameters)
    if index >= cast(int, spec.grid_size()):
        return None
    values: dict[tuple[str, ...], Any] = {}
    rest = index
    for path, param in sorted(params, key=lambda item: item[0], reverse=True):
        rest, position = divmod(rest, cast(int, param.size))
        values[path] = param.at(position)
    return _nest(spec.parameters, values)


def _random(spec: SweepSpec, index: int, seed: int) -> dict[tuple[str, ...], Any]:
    return {
        path: sample(param, random.Random(f"{seed}:{index}:{'/'.join(path)}"))
        for path, param in leaves(spec.parameters)
    }


def sample(param: ParamSpec, rng: random.Random) -> Any:
    """One draw of ``param``; the ``q_`` variants are rounded to a multiple of q as in W&B."""
    dist = param.distribution
    if dist == "constant":
        return param.at(0)
    if dist == "categorical":
        n = len(param.values)
        i = (
            rng.choices(range(n), weights=param.probabilities)[0]
            if param.probabilities
            else rng.randrange(n)
        )
        return param.at(i)
    if dist == "int_uniform":
        return rng.randint(int(cast(int, param.min)), int(cast(int, param.max)))
    if dist in NORMALS:
        z = min(max(rng.normalvariate(0.0, 1.0), -Z_MAX), Z_MAX)
        x = param.mu + param.sigma * z
    elif dist in BETAS:
        x = rng.betavariate(param.a, param.b)
    else:
        low, high = cast(float, param.low), cast(float, param.high)
        if dist in ("uniform", "q_uniform"):
            x = rng.uniform(low, high)
        elif dist == "inv_log_uniform":  # W&B's exp(-u): 1/x is the log-uniform one
            x = math.exp(-rng.uniform(cast(float, param.min), cast(float, param.max)))
        elif dist == "inv_log_uniform_values":
            x = math.exp(-rng.uniform(-math.log(high), -math.log(low)))
        else:
            x = math.exp(rng.uniform(math.log(low), math.log(high)))
    if dist in ("log_normal", "q_log_normal"):
        x = math.exp(x)
    return param.quantize(x) if dist.startswith("q_") else param.clamp(x)


def _nest(
    parameters: Mapping[str, ParamSpec],
    values: Mapping[tuple[str, ...], Any],
    prefix: tuple[str, ...] = (),
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, param in parameters.items():
        path = (*prefix, name)
        if param.parameters is not None:
            out[name] = _nest(param.parameters, values, path)
        else:
            out[name] = values[path]
    return out


def _bayes(
    spec: SweepSpec, history: Sequence[Observation], index: int, seed: int
) -> dict[tuple[str, ...], Any]:
    """TPE's values for the parameters that vary; {} while too few runs have finished."""
    done = [o for o in history if o.finished and finite_number(o.metric)]
    searched = [(path, p) for path, p in leaves(spec.parameters) if not _fixed(p)]
    if len(done) < N_STARTUP or not searched:
        return {}
    optuna = _import_optuna()
    space = {"/".join(path): _distribution(optuna, p) for path, p in searched}
    trials = []
    for o in sorted(done, key=_order):
        params = {}
        for path, p in searched:
            internal = _internal(p, _lookup(o.params, path))
            if internal is None:
                break  # a run this spec cannot have proposed (edited by hand): leave it out
            params["/".join(path)] = internal
        else:
            trials.append(
                optuna.trial.create_trial(params=params, distributions=space, value=o.metric)
            )
    if len(trials) < N_STARTUP:
        return {}
    with _quiet(optuna):
        sampler = optuna.samplers.TPESampler(seed=_seed32(seed, index), n_startup_trials=N_STARTUP)
        study = optuna.create_study(direction=cast(Any, spec.metric).goal, sampler=sampler)
        study.add_trials(trials)
        trial = study.ask(space)
    return {path: _external(p, trial.params["/".join(path)]) for path, p in searched}


def _import_optuna() -> Any:
    try:
        import optuna
    except ImportError as exc:
        raise ConfigError(
            "method: bayes needs Optuna, which is not installed here; "
            "pip install 'preemptible[bayes]'"
        ) from exc
    return optuna


@contextlib.contextmanager
def _quiet(optuna: Any) -> Iterator[None]:
    """Optuna logs every study it creates at INFO, and an agent creates one per run; TPE's
    numpy warns on extreme ranges (int_uniform over +-2**53) while still answering in bounds."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            warnings.simplefilter("ignore", RuntimeWarning)
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def _fixed(param: ParamSpec) -> bool:
    """Nothing for TPE to search: one value, or a range a few ulps wide (its Parzen estimator
    then has zero bandwidth and proposes nan; the random draw covers such a range)."""
    if param.size == 1 or param.low is None or param.high is None:
        return param.size == 1
    return math.isclose(param.low, param.high, rel_tol=1e-9)


def _distribution(optuna: Any, param: ParamSpec) -> Any:
    d = optuna.distributions
    dist = param.distribution
    if dist == "categorical":  # by index: values may be lists or mappings
        return d.CategoricalDistribution(tuple(range(len(param.values))))
    if dist == "int_uniform":
        return d.IntDistribution(param.min, param.max)
    if dist in NORMALS:  # unbounded: searched through its CDF, which keeps the prior
        return d.FloatDistribution(U_MIN, 1.0 - U_MIN)
    log = dist in LOG_UNIFORMS
    if dist.startswith("q_"):  # by the multiplier k of q (rounding can give k = 0: not log)
        kmin = cast(int, param.kmin)
        return d.IntDistribution(kmin, param.kmax, log=log and kmin >= 1)
    return d.FloatDistribution(param.low, param.high, log=log)


def _internal(param: ParamSpec, value: Any) -> Any:
    """``value`` as ``_distribution(param)`` represents it, or None if it cannot be."""
    dist = param.distribution
    if dist == "categorical":
        key = _canonical_or_none(value)
        matches = [i for i, v in enumerate(param.values) if canonical(v) == key]
        return matches[0] if matches else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite_number(value):
        return None
    if dist == "int_uniform":
        ok = isinstance(value, int) and cast(int, param.min) <= value <= cast(int, param.max)
        return value if ok else None
    if dist in NORMALS:
        x = value
        if dist in ("log_normal", "q_log_normal"):
            if value <= 0:
                return None
            x = math.log(value)
        u = NormalDist(param.mu, param.sigma).cdf(x)
        return min(max(u, U_MIN), 1.0 - U_MIN)
    if dist.startswith("q_"):
        ratio = value / cast(float, param.q)
        if not math.isfinite(ratio):
            return None
        k = round(ratio)
        return k if cast(int, param.kmin) <= k <= cast(int, param.kmax) else None
    low, high = cast(float, param.low), cast(float, param.high)
    return float(value) if low <= value <= high else None


def _external(param: ParamSpec, internal: Any) -> Any:
    dist = param.distribution
    if dist == "categorical":
        return param.at(int(internal))
    if dist == "int_uniform":
        return int(internal)
    if dist in NORMALS:
        u = min(max(float(internal), U_MIN), 1.0 - U_MIN)
        x = NormalDist(param.mu, param.sigma).inv_cdf(u)
        if dist in ("log_normal", "q_log_normal"):
            x = math.exp(x)
        return param.quantize(x) if dist.startswith("q_") else x
    if dist.startswith("q_"):
        return param.multiple(int(internal))
    return param.clamp(float(internal))


def _lookup(params: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = params
    for name in path:
        if not isinstance(node, Mapping) or name not in node:
            return _MISSING
        node = node[name]
    return node


def _canonical_or_none(value: Any) -> str | None:
    try:
        return canonical(value)
    except (TypeError, ValueError):
        return None


def _order(o: Observation) -> str:
    return json.dumps([o.params, o.metric], sort_keys=True, default=repr)


def _seed32(seed: int, index: int) -> int:
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big")
