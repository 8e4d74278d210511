"""What a front end is given and the kit checks once: the termination config, the checkpoint
directory (the front end's own or the supervisor's), whether this process is rank 0."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .._errors import ConfigError
from .._run import current_run
from .._torch import initialized_dist
from ..checkpoint._location import is_url, local_or_url
from ..stop._termination import TerminationConfig

logger = logging.getLogger("preemptible")

_warned_dirs = False


def termination_config_of(config: TerminationConfig | None) -> TerminationConfig:
    """``config``, or the detected platform's watchers and grace period when None."""
    if config is None:
        from ..notices import default_config

        return default_config()
    if not isinstance(config, TerminationConfig):
        raise ConfigError(
            f"termination_config must be a TerminationConfig, not {type(config).__name__}"
        )
    return config


def saving_config(config: TerminationConfig | None, front_end: str) -> TerminationConfig:
    """``termination_config_of`` for a front end whose framework writes the checkpoint itself:
    a ``save_fn`` would never be called, so it is refused (``front_end`` names who saves)."""
    config = termination_config_of(config)
    if config.save_fn is not None:
        raise ConfigError(f"termination_config.save_fn is not used by {front_end}; leave it None")
    return config


def exit_code_of(code: int | None) -> int | None:
    """A front end's fixed exit code for every stop, checked (None: 128 + signum)."""
    whole = isinstance(code, int) and not isinstance(code, bool)
    if code is not None and not (whole and 0 <= code <= 255):
        raise ConfigError(f"exit_code={code!r} is not valid; use None (128 + signum) or 0-255")
    return code


def checkpoint_directory(given: str | os.PathLike[str] | None) -> Path | str:
    """The front end's own directory, else the supervisor's (``PREEMPTIBLE_CHECKPOINT_DIR``);
    warn once when they differ. A URL (``s3://bucket/prefix``, ``gs://``, ``az://``) is kept
    as it is, a string: ``CheckpointStore`` stages it locally and mirrors it to the bucket
    (``Path`` would fold its ``//`` and make it a relative directory here)."""
    global _warned_dirs
    run = current_run()
    from_env: str | None = run.checkpoint_url
    if from_env is None and run.checkpoint_dir is not None:
        from_env = str(run.checkpoint_dir)
    if given is None:
        if from_env is None:
            raise ConfigError(
                "no checkpoint directory: pass checkpoint_dir, or run under "
                "`preemptible run`, which sets PREEMPTIBLE_CHECKPOINT_DIR"
            )
        return local_or_url(from_env) if run.checkpoint_url is not None else Path(from_env)
    where = local_or_url(given)
    if from_env is not None and not _same_place(where, from_env):
        defaulted = run.checkpoint_dir_default
        if not defaulted and not _warned_dirs:
            _warned_dirs = True
            logger.warning(
                "preemptible: checkpoints go to %s (the handler's checkpoint_dir), not to %s "
                "(preemptible run's --checkpoint-dir); pass checkpoint_dir=None to use the "
                "supervisor's, or give both the same directory",
                where,
                from_env,
            )
    return where


def _same_place(where: Path | str, other: str) -> bool:
    if isinstance(where, str) or is_url(other):
        return str(where).rstrip("/") == other.rstrip("/")
    return Path(other).resolve() == where.resolve()


def is_rank_zero() -> bool:
    """Rank 0 of an initialized torch.distributed group, or not distributed at all."""
    dist = initialized_dist()
    try:
        if dist is not None:
            return int(dist.get_rank()) == 0
    except Exception:  # pragma: no cover - a half-initialized group
        pass
    rank = os.environ.get("RANK")
    return not (rank and rank.isdecimal() and int(rank) != 0)
