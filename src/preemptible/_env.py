"""Environment variables, validated where they are read.

Every ``PREEMPTIBLE_*`` value (and the few foreign ones preemptible reads) goes through one of
these readers, so a bad value always gives the same kind of answer: a ``ConfigError`` with one
line naming the variable, the value and what is valid. An unset or empty variable means
"not given" and returns the default.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

from ._errors import ConfigError


def env_str(name: str) -> str | None:
    """The value, or None when unset or empty."""
    value = os.environ.get(name)
    return value if value else None


def env_float(
    name: str,
    default: float | None = None,
    *,
    min_value: float | None = 0.0,
    max_value: float | None = None,
    strict_min: bool = False,
    what: str = "seconds",
) -> float | None:
    """A finite number (nan and inf are refused), within the given bounds."""
    raw = env_str(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    too_low = min_value is not None and (value <= min_value if strict_min else value < min_value)
    too_high = max_value is not None and value > max_value
    if not math.isfinite(value) or too_low or too_high:
        bounds = []
        if min_value is not None:
            bounds.append(f"{'>' if strict_min else '>='} {min_value:g}")
        if max_value is not None:
            bounds.append(f"<= {max_value:g}")
        raise ConfigError(
            f"{name}={raw!r} is not valid; use {what}"
            + (f" {' and '.join(bounds)}" if bounds else "")
            + ", e.g. 30"
        )
    return value


def env_int(
    name: str, default: int | None = None, *, min_value: int | None = 0, what: str = "an integer"
) -> int | None:
    raw = env_str(name)
    if raw is None:
        return default
    text = raw.strip()
    digits = text[1:] if text.startswith("-") else text
    ok = digits.isascii() and digits.isdigit()  # not "²": isdigit() alone takes it
    value = int(text) if ok and len(text) <= 18 else None
    if value is None or (min_value is not None and value < min_value):
        bound = f" >= {min_value}" if min_value is not None else ""
        raise ConfigError(f"{name}={raw!r} is not valid; use {what}{bound}")
    return value


def env_choice(name: str, choices: Iterable[str], default: str | None = None) -> str | None:
    raw = env_str(name)
    if raw is None:
        return default
    valid = list(choices)
    if raw not in valid:
        raise ConfigError(f"{name}={raw!r} is not valid; use one of {', '.join(valid)}")
    return raw
