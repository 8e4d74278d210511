"""What every ``preemptible`` subcommand shares: the context settings, ``--home``, failing."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from .._errors import PreemptibleError

# No auto_envvar_prefix: an option reads an environment variable only where it names one
# (envvar=..., shown in --help). Automatic PREEMPTIBLE_<OPTION> names turned variables set for
# other purposes into options: PREEMPTIBLE_NOW=1 made `sweep cancel` SIGKILL, and the
# PREEMPTIBLE_RUN_ID every attempt gets made a nested `preemptible run` join its parent's run.
# Nothing destructive (--now) and nothing a supervisor sets for its attempts reads one.
CONTEXT = {"help_option_names": ["-h", "--help"]}


def _home_option(help_text: str) -> Callable[[Any], Any]:
    """``--home`` (``PREEMPTIBLE_HOME``), where run directories go; each command says why."""
    option: Callable[[Any], Any] = click.option(
        "--home",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path(".preemptible"),
        show_default=True,
        envvar="PREEMPTIBLE_HOME",
        show_envvar=True,
        help=help_text,
    )
    return option


class CheckpointLocation(click.ParamType[Any, Any]):
    """A checkpoint directory, or a bucket's URL (``s3://bucket/prefix``, ``gs://``, ``az://``),
    which is kept as it is (checked here: a bad one is a usage error naming what is valid)."""

    name = "dir_or_url"  # --help shows DIR_OR_URL: a URL is as valid as a directory

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from ..checkpoint._location import is_url, local_or_url

        if isinstance(value, str) and is_url(value):
            try:
                value = local_or_url(value)
            except PreemptibleError as exc:
                self.fail(str(exc), param, ctx)
            if isinstance(value, str):
                return value
        return click.Path(file_okay=False, path_type=Path).convert(value, param, ctx)


def _fail(message: str, code: int = 2) -> NoReturn:
    click.echo(f"preemptible: {message}", err=True)
    sys.exit(code)
