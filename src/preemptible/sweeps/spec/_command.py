"""The command of one sweep run: W&B's macros expanded into an argv list, run without a shell.

Values are formatted as W&B's agent formats them (Python's ``str()``: ``--lr=0.1``,
``--flag=True``, a nested parameter as ``--opt={'lr': 0.1}``; ``${args_no_equals}`` as the two
elements ``--lr 0.1``, Hydra's ``+lr=0.1`` and ``++lr=0.1``), so a training script written for
``wandb agent`` parses the same arguments here. Without a shell nothing is re-split or
expanded: a value with spaces, quotes or ``$`` reaches the program as one argument, unchanged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from ..._env import env_str
from ..._errors import ConfigError
from ..._files import write_text_atomic
from ..._text import short_repr


class Commanded(Protocol):
    """What a command is built from: a sweep spec's ``program`` and ``command`` (a protocol,
    so that this module, which the spec's checks use, does not import the spec)."""

    @property
    def program(self) -> str | None: ...

    @property
    def command(self) -> tuple[str, ...]: ...


DEFAULT_COMMAND = ("${env}", "${interpreter}", "${program}", "${args}")
ENV = "/usr/bin/env"

# One element each, so they may also stand inside a longer element: --cfg=${args_json_file}.
SINGLE_MACROS = ("env", "interpreter", "program", "args_json", "args_json_file")
# One element per parameter (two for args_no_equals): only as a whole element.
MULTI_MACROS = (
    *("args", "args_no_hyphens", "args_no_boolean_flags", "args_no_equals"),
    *("args_append_hydra", "args_override_hydra"),
)
VALID_MACROS = ", ".join(
    [f"${{{name}}}" for name in (*SINGLE_MACROS, *MULTI_MACROS)] + ["${envvar:NAME}"]
)

_MACRO = re.compile(r"\$\{([^{}]*)\}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def macro_problem(element: str) -> str | None:
    """Why ``element`` cannot be expanded (one line), or None. Used when the spec is parsed."""
    for match in _MACRO.finditer(element):
        name = match.group(1)
        if name in MULTI_MACROS:
            if match.group(0) != element:
                return (
                    f"${{{name}}} expands to one argument per parameter, so it must be a whole "
                    f"element of the list, not part of {short_repr(element)}"
                )
        elif name.startswith("envvar:"):
            if not _ENV_NAME.fullmatch(name[len("envvar:") :]):
                return f"{short_repr(match.group(0))} does not name an environment variable"
        elif name not in SINGLE_MACROS:
            return f"{short_repr(match.group(0))} is not a macro; valid: {VALID_MACROS}"
    return None


def uses_macro(command: tuple[str, ...], name: str) -> bool:
    return any(match.group(1) == name for element in command for match in _MACRO.finditer(element))


def build_command(
    spec: Commanded, params: Mapping[str, Any], *, interpreter: str, params_file: Path
) -> list[str]:
    """The argv of a run with ``params``; writes ``params_file`` only if the command uses it.

    A macro that is a whole element expands to zero or more elements (``${args}`` with no
    parameters to none); inside a longer element a single-valued macro is substituted in
    place. ``${envvar:NAME}`` is read from this process's environment; unset is a
    ConfigError, since the program would otherwise get an argument nobody meant.
    """
    flags = [(str(name), value) for name, value in params.items()]
    multi = {
        "args": [f"--{name}={value}" for name, value in flags],
        "args_no_hyphens": [f"{name}={value}" for name, value in flags],
        "args_no_boolean_flags": [
            f"--{name}" if value is True else f"--{name}={value}"
            for name, value in flags
            if value is not False
        ],
        # --lr 0.1: the value is its own element, so a value that starts with '-' may be
        # taken for an option by the program's parser, as under wandb agent
        "args_no_equals": [
            element for name, value in flags for element in (f"--{name}", f"{value}")
        ],
        "args_append_hydra": [f"+{name}={value}" for name, value in flags],  # Hydra: add a key
        "args_override_hydra": [f"++{name}={value}" for name, value in flags],  # add or override
    }
    as_json = json.dumps(dict(flags))
    single = {
        "env": ENV,
        "interpreter": interpreter,
        "program": spec.program or "",
        "args_json": as_json,
        "args_json_file": str(params_file),
    }

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name.startswith("envvar:"):
            value = env_str(name[len("envvar:") :])
            if value is None:
                raise ConfigError(
                    f"command: {match.group(0)} names an environment variable that is not set "
                    "(or empty) where the agent runs"
                )
            return value
        return single[name]  # macro_problem() has checked the name

    argv: list[str] = []
    for element in spec.command:
        whole = _MACRO.fullmatch(element)
        if whole and whole.group(1) in multi:
            argv.extend(multi[whole.group(1)])
        else:
            problem = macro_problem(element)
            if problem is not None:
                raise ConfigError(f"command: {problem}")
            argv.append(_MACRO.sub(substitute, element))
    if uses_macro(spec.command, "args_json_file"):
        params_file.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(params_file, as_json + "\n")  # a planted link is replaced, not followed
    return argv
