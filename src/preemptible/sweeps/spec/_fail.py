"""The words of the spec's errors: ``_fail`` and its exception, and how a value is named in
a message without quoting a file that is not a spec (see ``_spec``)."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping
from typing import NoReturn, TypeVar

from ..._errors import ConfigError
from ..._text import short_repr
from ._model import TOP_KEYS, WANDB_IGNORED

T = TypeVar("T")

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.-]+")


class _Invalid(Exception):
    """A problem a check found (``_fail``); ``_checked`` makes it one ConfigError line."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(path, problem)
        self.path = path
        self.problem = problem


def _fail(path: str, problem: str) -> NoReturn:
    raise _Invalid(path, problem)


def _checked(check: Callable[[object], T], data: object, source: str) -> T:
    """``check(data)``, with the problem it finds raised as one ConfigError line that names
    ``source`` and the key path."""
    try:
        return check(data)
    except _Invalid as exc:
        where = f"{exc.path}: " if exc.path else ""
        raise ConfigError(f"{_clean(source)}: {where}{exc.problem}") from None


def _number(path: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = ""
        if isinstance(value, str) and _looks_like_float(value):
            hint = f" (YAML reads {value} as text; write it with a dot, e.g. 1.0e-5)"
        _fail(path, f"must be a number, not {_what(value)}{hint}")
    return value


def finite_number(value: object) -> bool:
    """A real number a float holds, not a bool: what a bound, a target or a metric must be (an
    integer beyond float's range is not one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except (OverflowError, ValueError, TypeError):
        return False


def _looks_like_float(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _integer(path: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(path, f"must be an integer, not {_what(value)}")
    return value


def _is_spec(data: object) -> bool:
    """A mapping with at least one key of a sweep spec: a spec, maybe with mistakes, whose
    keys and values may be quoted in errors."""
    return isinstance(data, Mapping) and any(
        isinstance(key, str) and (key in TOP_KEYS or key in WANDB_IGNORED) for key in data
    )


def kind_of(value: object) -> str:
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
        return f"text {short_repr(value)}"
    if isinstance(value, int):
        return f"integer {short_repr(value)}"
    if isinstance(value, float):
        return f"number {short_repr(value)}"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, Mapping):
        return "a mapping"
    return f"a {type(value).__name__} ({short_repr(value)})"


def _key(key: object) -> str:
    return key if isinstance(key, str) and _PLAIN_KEY.fullmatch(key) else short_repr(key)


def _flat(text: str) -> str:
    return " ".join(text.split())


def _clean(source: str) -> str:
    return source if source.isprintable() else short_repr(source)
