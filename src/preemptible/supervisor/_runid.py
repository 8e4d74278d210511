"""Run ids: which run directory under ``--home`` a ``preemptible run`` continues.

The id is stable by default (from the checkpoint directory, else from the working directory
and the command; ``slurm-JOBID`` under SLURM), so running the same command again continues
the same run; a run started inside another run's attempt is a run of its own.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from .._errors import ConfigError
from . import _slurm

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_run_id(run_id: str, source: str = "--run-id") -> str:
    """``run_id`` names a directory under --home: refuse anything that is not a plain name."""
    if not _RUN_ID.fullmatch(run_id):
        raise ConfigError(
            f"run id {run_id!r} (from {source}) is not valid; use 1-128 letters, digits, '.', "
            "'_' or '-', starting with a letter or digit"
        )
    return run_id


def default_run_id(
    command: list[str], checkpoint_dir: Path | str | None, parent: str | None = None
) -> tuple[str, str]:
    """The run id when none was given, and why it is that one. Stable: the same job started
    again (by hand, by a scheduler, after a crash of the supervisor) continues the same run
    directory, attempt numbers and default checkpoints instead of starting a new history.

    Inside an attempt of another run ``parent`` (a job script that itself uses ``preemptible
    run``, under an agent or another supervisor: ``_parent.py``) the run is a run of its own:
    its id is derived as below, together with the parent run's id, and never the SLURM job's,
    which the parent has; the same parent run gets the same nested run again, so resumes work
    at both levels.
    """
    job = _slurm.job_id() if parent is None else None
    if job is not None:
        run_id = check_run_id(f"slurm-{job}", "the SLURM job id")
        return run_id, "the SLURM job; a requeued job continues this run"
    try:
        if isinstance(checkpoint_dir, str):  # a bucket's URL: the same wherever it runs
            key = checkpoint_dir.rstrip("/")
            name = key.rsplit("/", 1)[-1]
            why = f"from the checkpoint URL {checkpoint_dir}"
        elif checkpoint_dir is not None:
            where = checkpoint_dir.resolve()
            name, key = where.name, str(where)
            why = f"from the checkpoint directory {where}"
        else:
            cwd = Path.cwd()
            name, key = _command_name(command), "\0".join([str(cwd), *command])
            why = f"from the working directory {cwd} and the command"
    except OSError as exc:  # the working directory was removed under us
        raise ConfigError(f"cannot derive a run id ({exc.strerror or exc}); pass --run-id") from exc
    if parent is not None:
        key = f"{parent}\0{key}"
        why = f"inside an attempt of run {parent!r}; {why}"
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).lstrip("-._")[:40] or "run"
    return f"{slug}-{digest}", why


def _command_name(command: list[str]) -> str:
    """``train`` for ``python train.py``, ``mod`` for ``python -m pkg.mod``, else the program."""
    args = command[1:]
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args):
            return args[i + 1].rsplit(".", 1)[-1]
        if not arg.startswith("-") and Path(arg).suffix in (".py", ".sh"):
            return Path(arg).stem
    return Path(command[0]).name
