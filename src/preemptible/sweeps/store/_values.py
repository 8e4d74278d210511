"""The values the sweep queue stores, checked and cleaned: JSON text, counts and seconds
(``ConfigError`` for a caller's bad argument), a run's reported metrics and checkpoint steps
(dropped with a warning: one run's bad value never stops the sweep), the sweep metric read back
from a summary, and new sweep ids."""

from __future__ import annotations

import json
import logging
import math
import secrets
from collections.abc import Mapping
from typing import Any

from ..._errors import ConfigError
from ..._paths import MAX_STEP
from ..._text import printable, short_repr
from ..spec._fail import finite_number
from ._fields import decode_object

logger = logging.getLogger("preemptible")

_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
MAX_COUNT = 2**31 - 1  # run_cap, max_failures, max_preemptions: PostgreSQL integer columns
MIN_STEP = -(MAX_STEP + 1)  # checkpoint_step: a bigint (SQLite: INTEGER)
_MAX_SUMMARY_DEPTH = 32
_MAX_WARNED = 10_000
_warned: set[tuple[str, str]] = set()  # (run, metric) whose dropped value was logged


def _json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} is not JSON-serializable ({exc}); use plain values") from None


def _loads(text: object) -> Any:
    """A stored JSON object, or None when it is NULL or cannot be read back (_fields)."""
    return decode_object(text)[0]


def _check_int(
    name: str, value: object, low: int, *, high: int = MAX_COUNT, none_ok: bool = False
) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        extra = " or None" if none_ok else ""
        raise ConfigError(
            f"{name}={short_repr(value)} is not valid; use an integer from {low} to {high}{extra}"
        )


def _number_ok(value: object) -> bool:
    """A finite number that a float holds (a bool counts: it is JSON's true/false)."""
    return isinstance(value, bool) or finite_number(value)


def _storable(value: object, depth: int = 0) -> bool:
    """Whether a summary value can be stored and read back as it is: plain JSON whose
    numbers are all finite floats (or ints a float can hold)."""
    if depth > _MAX_SUMMARY_DEPTH:
        return False
    if value is None or isinstance(value, str):
        return True
    if isinstance(value, (bool, int, float)):
        return _number_ok(value)
    if isinstance(value, (list, tuple)):
        return all(_storable(item, depth + 1) for item in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _storable(v, depth + 1) for k, v in value.items())
    return False


def clean_summary(summary: Mapping[str, Any], run_id: str) -> dict[str, Any]:
    """The run's reported metrics that can be stored; the others (a NaN, an infinity, an
    integer too large for a float, anything not plain JSON) are dropped with a warning, so
    that one run's bad value never stops the agent or the sweep's readers."""
    kept: dict[str, Any] = {}
    dropped: list[str] = []
    for key, value in summary.items():
        if isinstance(key, str) and _storable(value):
            kept[key] = value
            continue
        shown = printable(key[:40] if isinstance(key, str) else short_repr(key, 40))
        if (run_id, shown) not in _warned:  # a run reports every step: say it once
            dropped.append(shown)
            if len(_warned) >= _MAX_WARNED:
                _warned.clear()
            _warned.add((run_id, shown))
    if dropped:
        logger.warning(
            "preemptible: run %s reported %s that %s not a finite number or plain JSON data; "
            "not stored",
            run_id,
            ", ".join(dropped[:10])
            + (f" and {len(dropped) - 10} more" if len(dropped) > 10 else ""),
            "is" if len(dropped) == 1 else "are",
        )
    return kept


def clean_step(step: object, where: str) -> int | None:
    """A checkpoint step the database can hold (a signed 64-bit integer), else None (unknown)
    with a warning: a file name with a step of 30 digits must not stop the agent."""
    if step is None:
        return None
    if isinstance(step, int) and not isinstance(step, bool) and MIN_STEP <= step <= MAX_STEP:
        return step
    logger.warning(
        "preemptible: %s has checkpoint step %s, which is not an integer from %d to %d; "
        "recorded as unknown",
        printable(where),
        short_repr(step),
        MIN_STEP,
        MAX_STEP,
    )
    return None


def _check_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r} is not valid; use seconds > 0")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name}={value!r} is not valid; use seconds > 0")


def _new_id() -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))


def _metric_name(spec: Mapping[str, Any]) -> str | None:
    metric = spec.get("metric")
    if isinstance(metric, Mapping):
        metric = metric.get("name")
    return metric if isinstance(metric, str) else None


def _metric(summary: Any, name: str | None) -> float | None:
    """The metric ``name`` of a stored summary as a finite float; None if missing or not one
    (text, a NaN, an infinity, an integer too large for a float: whatever was stored)."""
    if name is None or not isinstance(summary, Mapping):
        return None
    value = summary.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
