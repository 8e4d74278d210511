"""Hyperband early termination (``early_terminate: {type: hyperband, ...}``), decided as W&B does.

A sweep's runs are compared at a few fixed lengths of their metric history, the *bands*. A
run's history is the sequence of values of the sweep's metric it has reported, in order;
values that are not finite numbers (NaN, infinities, text, None, booleans) are left out
before anything is counted, so a run that went NaN stops growing its history. "Iteration n"
of a run is the n-th value that is left.

The bands come from the config in one of two forms:

* ``min_iter`` (and ``eta``, default 3): ``min_iter, min_iter*eta, min_iter*eta^2, ...``
  rounded down, the first band being the earliest point a run can be stopped. W&B lays out
  100 of them; those beyond ``ITER_LIMIT`` are left out here, as no history is that long.
* ``max_iter`` and ``s``: ``max_iter/eta, max_iter/eta^2, ...`` rounded down, ``s`` of them
  at most and none below 1, so the last band (the largest) lies ``eta`` times before
  ``max_iter``.

At each band b, the runs whose history has reached b (every run of the sweep, finished,
failed or still running) give their b-th value; with the values sorted best first, the one
at position ``int(n / eta)`` (counted from 0, of n values) is the band's threshold: about
the best 1/eta of the runs are at or better than it. A *running* run is judged at the last
band its own history has reached, and only there; before the first band it is never stopped.
It is stopped when it is worse than that threshold: in ``strict`` mode (the default) by its
own value at that band, otherwise (``strict: false``) by the best value anywhere in its
history, which spares a run that was good once. Worse means greater for ``goal: minimize``
and smaller for ``goal: maximize``; a tie with the threshold is never stopped. The decision
depends only on the histories, never on the order of the runs or their ids.

The arithmetic follows W&B's (``1.0 / eta`` times n, bands by repeated multiplication or
division), so the same histories give the same decisions. Where W&B would fail or silently
pick one reading, the config is refused instead: ``s`` without ``max_iter``, ``min_iter``
together with ``max_iter``, ``max_iter`` smaller than ``eta`` (no band at all), and keys W&B's
schema does not know.

Pure: no I/O, no clock, nothing imported beyond the standard library and the error type.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, Literal

from ..._errors import ConfigError
from ..._text import short_repr
from ._fail import _what, finite_number  # one wording of what a bad value is

Goal = Literal["minimize", "maximize"]
GOALS: tuple[Goal, ...] = ("minimize", "maximize")
TYPES = ("hyperband",)
KEYS = ("type", "min_iter", "max_iter", "s", "eta", "strict")
DEFAULT_ETA = 3
DEFAULT_STRICT = True
ITER_LIMIT = 2**31 - 1  # min_iter, max_iter: no run reports its metric more often than this
MAX_S = 100  # the number of bands W&B lays out for the min_iter form
_WHERE = "early_terminate"
_EXAMPLE = "{type: hyperband, min_iter: 3}"
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True, kw_only=True)
class Hyperband:
    """A checked ``early_terminate`` config: ``min_iter``, or ``max_iter`` and ``s``."""

    min_iter: int | None = None
    max_iter: int | None = None
    s: int | None = None
    eta: float = DEFAULT_ETA
    strict: bool = DEFAULT_STRICT

    def __post_init__(self) -> None:
        problem = early_terminate_problem(self.raw())
        if problem is not None:
            raise ConfigError(problem)

    def raw(self) -> dict[str, Any]:
        """The config as a spec writes it (``type`` included, unset keys left out)."""
        out: dict[str, Any] = {"type": "hyperband"}
        for key in ("min_iter", "max_iter", "s"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["eta"] = self.eta
        out["strict"] = self.strict
        return out


def early_terminate_problem(raw: object) -> str | None:
    """What is wrong with an ``early_terminate`` value, as one line that names the key and
    what is valid; None when it is a valid Hyperband config. Never raises."""
    if not isinstance(raw, Mapping):
        return f"{_WHERE}: must be a mapping, e.g. {_EXAMPLE}; not {_what(raw)}"
    for key in raw:
        if not isinstance(key, str):
            return f"{_WHERE}: key {short_repr(key)} must be text; valid: {', '.join(KEYS)}"
        if key not in KEYS:
            return f"{_path(key)}: not a key of early_terminate; valid: {', '.join(KEYS)}"
    if "type" not in raw:
        return f"{_WHERE}.type: required; valid: {', '.join(TYPES)}"
    if not isinstance(raw["type"], str) or raw["type"] not in TYPES:
        return f"{_WHERE}.type: {short_repr(raw['type'])} is not valid; valid: {', '.join(TYPES)}"
    for key, top, what in (
        ("min_iter", ITER_LIMIT, "the first band"),
        ("max_iter", ITER_LIMIT, "the last band is max_iter / eta"),
        ("s", MAX_S, "how many bands below max_iter"),
    ):
        if key in raw and not _integer_within(raw[key], top):
            return (
                f"{_WHERE}.{key}: must be an integer from 1 to {top} ({what}), "
                f"not {_what(raw[key])}"
            )
    eta = raw.get("eta", DEFAULT_ETA)
    if not _number_above_one(eta):
        return (
            f"{_WHERE}.eta: must be a finite number > 1 (the top 1/eta of the runs go on at "
            f"each band; default {DEFAULT_ETA}), not {_what(eta)}"
        )
    if "strict" in raw and not isinstance(raw["strict"], bool):
        return f"{_WHERE}.strict: must be true or false (default true), not {_what(raw['strict'])}"
    has_min, has_max, has_s = ("min_iter" in raw), ("max_iter" in raw), ("s" in raw)
    if not has_min and not has_max:
        return (
            f"{_WHERE}: give min_iter (the first band), or max_iter and s (the last band is "
            f"max_iter / eta, and s bands at most), e.g. {_EXAMPLE}"
        )
    if has_min and (has_max or has_s):
        other = "max_iter" if has_max else "s"
        return (
            f"{_WHERE}: give min_iter, or max_iter and s, not min_iter with {other} "
            "(W&B would go by max_iter and s alone)"
        )
    if has_max and not has_s:
        return f"{_WHERE}.s: required with max_iter: how many bands below it, e.g. s: 2"
    if has_max and raw["max_iter"] / eta < 1:
        return (
            f"{_WHERE}: max_iter ({raw['max_iter']}) / eta ({short_repr(eta)}) is below 1, which "
            "leaves no band; use a max_iter of at least eta"
        )
    return None


def parse_early_terminate(raw: object) -> Hyperband:
    """The checked config, or ConfigError with ``early_terminate_problem``'s line."""
    problem = early_terminate_problem(raw)
    if problem is not None:
        raise ConfigError(problem)
    assert isinstance(raw, Mapping)
    return Hyperband(
        min_iter=raw.get("min_iter"),
        max_iter=raw.get("max_iter"),
        s=raw.get("s"),
        eta=raw.get("eta", DEFAULT_ETA),
        strict=raw.get("strict", DEFAULT_STRICT),
    )


def bands(config: Hyperband) -> list[int]:
    """The history lengths at which runs are compared, ascending, each once."""
    found: list[int] = []
    if config.max_iter is not None:
        band: float = config.max_iter
        for _ in range(config.s or 0):
            band /= config.eta  # divided again each time, as W&B does: the same roundings
            if band < 1:
                break
            found.append(int(band))
    else:
        band = config.min_iter or 1
        for _ in range(MAX_S):
            if band > ITER_LIMIT:  # also an overflow to infinity; int() of it would raise
                break
            found.append(int(band))
            band *= config.eta
    return sorted(set(found))


def thresholds(
    config: Hyperband, *, goal: Goal, histories: Mapping[str, Sequence[float]]
) -> dict[int, float]:
    """Each band some history has reached -> the value a run must not be worse than there."""
    sign = _sign(goal)
    clean = [_valid(values, sign) for values in histories.values()]
    return {band: sign * cut for band, cut in _cuts(config, clean).items()}


def stop_decisions(
    config: Hyperband,
    *,
    goal: Goal,
    histories: Mapping[str, Sequence[float]],
    running: Set[str],
) -> set[str]:
    """The ids in ``running`` that Hyperband stops now. ``histories`` holds every run of the
    sweep (finished ones too: they set the thresholds), each run's metric values in the order
    reported; a running run without one is never stopped."""
    sign = _sign(goal)
    clean = {run: _valid(values, sign) for run, values in histories.items()}
    cuts = _cuts(config, list(clean.values()))
    return {run for run in running if _verdict(config, clean.get(run, []), cuts) is not None}


def stop_verdict(
    config: Hyperband,
    *,
    goal: Goal,
    band_values: Mapping[int, Sequence[float]],
    own: Sequence[float],
) -> tuple[int, float, float] | None:
    """``stop_decisions`` for one running run, from what the thresholds need alone: for each
    band b, the b-th value of every history (of finite values) that has b of them, the run's
    own included (``band_values``), and the run's own history. (band, the value judged, the
    band's threshold), in the goal's terms, when the run is stopped; else None."""
    sign = _sign(goal)
    cuts = _cut_bands(
        config, lambda band: [sign * v for v in band_values.get(band, ()) if finite_number(v)]
    )
    found = _verdict(config, _valid(own, sign), cuts)
    if found is None:
        return None
    band, value = found
    return band, sign * value, sign * cuts[band]


def _verdict(
    config: Hyperband, history: Sequence[float], cuts: Mapping[int, float]
) -> tuple[int, float] | None:
    """(band, value) when a running run with this clean history is stopped, else None: judged
    at the last band it reached, before the first never."""
    reached = [band for band in cuts if band <= len(history)]
    if not history or not reached:
        return None
    band = reached[-1]
    value = history[band - 1] if config.strict else min(history)
    return (band, value) if value > cuts[band] else None


def _cuts(config: Hyperband, clean: Sequence[Sequence[float]]) -> dict[int, float]:
    """Thresholds in "smaller is better" terms, ascending by band."""
    return _cut_bands(config, lambda band: [h[band - 1] for h in clean if len(h) >= band])


def _cut_bands(config: Hyperband, at_band: Callable[[int], list[float]]) -> dict[int, float]:
    """Thresholds from each band's values (``at_band(b)``: the b-th value of every history
    that long, smaller is better), ascending by band."""
    keep = 1.0 / config.eta
    out: dict[int, float] = {}
    for band in bands(config):
        values = sorted(at_band(band))
        if not values:  # no history is this long, so none reaches a later band either
            break
        out[band] = values[int(keep * len(values))]
    return out


def _sign(goal: str) -> int:
    if goal not in GOALS:
        raise ValueError(f"goal {goal!r} is not valid; valid: {', '.join(GOALS)}")
    return 1 if goal == "minimize" else -1


def _valid(values: Sequence[Any], sign: int) -> list[float]:
    """The finite numbers of a history, in order, negated for ``maximize``."""
    return [sign * value for value in values if finite_number(value)]


def _integer_within(value: object, top: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= top


def _number_above_one(value: object) -> bool:
    return finite_number(value) and isinstance(value, (int, float)) and value > 1


def _path(key: str) -> str:
    return f"{_WHERE}.{key}" if _PLAIN_KEY.fullmatch(key) else f"{_WHERE}[{short_repr(key)}]"
