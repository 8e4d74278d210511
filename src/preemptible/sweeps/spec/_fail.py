"""The words of the spec's errors: ``_fail`` and its exception, how a value is named in a
message without quoting a file that is not a spec (see ``_spec``), and how the problems of one
file are gathered into one error.

A check raises at the first problem of the thing it checks (a parameter, a top-level key),
because what follows may make no sense once that is wrong; ``_soft`` runs such a check and,
inside ``_checked``, notes its problem and carries on with the next thing, so that a file with
nine mistakes is answered with nine lines rather than nine attempts. ``_warn`` notes something
accepted but doubtful (a form W&B deprecates), for the caller to show."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any, NoReturn, TypeVar, cast

from ..._errors import ConfigError
from ..._text import short_repr
from ._model import TOP_KEYS, WANDB_IGNORED

T = TypeVar("T")

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.-]+")


class _Invalid(Exception):
    """A problem a check found (``_fail``); ``_checked`` makes it a line of its ConfigError."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(path, problem)
        self.path = path
        self.problem = problem


def _fail(path: str, problem: str) -> NoReturn:
    raise _Invalid(path, problem)


class _Notes:
    """What one ``_checked`` call found: the problems ``_soft`` carried on past, and warnings."""

    def __init__(self) -> None:
        self.problems: list[_Invalid] = []
        self.warnings: list[str] = []


_NOTES: ContextVar[_Notes | None] = ContextVar("sweep_spec_notes", default=None)


def _soft(check: Callable[..., T], *args: Any) -> T | None:
    """``check(*args)``; inside ``_checked``, a problem it finds is noted and None returned,
    so that the caller goes on to check the next thing (outside, the problem is raised)."""
    notes = _NOTES.get()
    try:
        return check(*args)
    except _Invalid as exc:
        if notes is None:
            raise
        notes.problems.append(exc)
        return None


def _warn(path: str, text: str) -> None:
    """Note something accepted but doubtful (outside ``_checked``, nothing is noted)."""
    notes = _NOTES.get()
    if notes is not None:
        notes.warnings.append(f"{path}: {text}" if path else text)


def _checked(check: Callable[[object], T], data: object, source: str) -> tuple[T, list[str]]:
    """``check(data)`` and the warnings it noted. Every problem found is raised as one
    ConfigError, a line per problem, each naming ``source`` and the key path."""
    notes = _Notes()
    token = _NOTES.set(notes)
    result: T | None = None
    try:
        result = check(data)
    except _Invalid as exc:
        notes.problems.append(exc)
    finally:
        _NOTES.reset(token)
    if notes.problems:
        lines = []
        for problem in notes.problems:
            where = f"{problem.path}: " if problem.path else ""
            lines.append(f"{_clean(source)}: {where}{problem.problem}")
        raise ConfigError("\n".join(lines)) from None
    return cast(T, result), notes.warnings


def _number(path: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = ""
        if isinstance(value, str) and _looks_like_float(value):
            hint = " (it is quoted, so it is text; write the number without quotes)"
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
