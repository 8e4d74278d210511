"""What an attempt is told, and what a nested run passes up.

The environment each attempt starts with: who it is (``PREEMPTIBLE_RUN_ID``,
``PREEMPTIBLE_ATTEMPT``, ``PREEMPTIBLE_RUN_DIR``), where it saves and whether that directory
was chosen for it (``PREEMPTIBLE_CHECKPOINT_DIR``, ``..._DEFAULT``), where it resumes from
(``PREEMPTIBLE_RESUME_FROM``), how long the exits of earlier attempts took
(``PREEMPTIBLE_EXIT_SECONDS``) and how long it has from a stop passed on to it to the SIGKILL
of its group (``PREEMPTIBLE_KILL_AFTER``: the term timeout, so that a stop with no deadline of
its own, a plain SIGTERM, still ends its wait for an upload before that kill). Which
signals torch's elastic agent (``torchrun``, ``accelerate launch --multi_gpu``) passes on to
its workers (``PET_SIGNALS_TO_HANDLE``, the environment's value of torchrun's
``--signals-to-handle``, unless the job's environment sets it): every stop signal the
supervisor passes on. The agent starts each worker in a session of its own, so the
supervisor's signal to the job's group reaches the agent alone; by default the agent passes on
TERM, INT, HUP and QUIT, and a USR1 (``sbatch --signal``) or USR2 killed it, and with it the
store its workers agree through, before they could save. A torch without that option ignores
the variable. The agent also SIGKILLs its workers its shutdown timeout after it passed a stop
on (30 s by default), before the supervisor's term timeout (60 s by default) is up: the
attempt's agent is given the term timeout (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, unless the
job's environment sets it), so that a worker's stop has all of it. And, when a nested run
ends, the record its last attempt passes up to the attempt of its parent run (``PASSED_UP``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

from .._errors import CheckpointRemoteError, ConfigError, PreemptibleError
from .._files import write_text_atomic
from .._paths import RECORD_NAME
from .._run import current_run, read_record
from ..checkpoint._location import not_a_directory
from ..stop._signals import STOP_SIGNALS
from ..stop._termination import EXIT_SECONDS_ENV
from ._config import SupervisorConfig
from ._journal import measured_exits
from ._resume import Resumes
from ._runfiles import RunFiles

logger = logging.getLogger("preemptible")

# torch's default (SIGTERM,SIGINT,SIGHUP,SIGQUIT) and every stop signal a supervisor passes on
ELASTIC_SIGNALS = ",".join(
    dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *(s.name for s in STOP_SIGNALS)])
)

# what a nested run passes up from its last attempt's record to its parent's attempt
PASSED_UP = (
    "state",
    "preempting",
    "preempting_at",
    "stopped_at",
    "committed_at",
    "signum",
    "step",
    "checkpoint",
    "checkpoint_dir",
    "remote_checkpoint",
)


def check_inherited_env() -> None:
    """The ``PREEMPTIBLE_*`` variables an attempt inherits and preemptible reads in it,
    checked by the readers the job uses: a bad value is one line (``ConfigError``) before any
    attempt starts, not an attempt that fails at its handler with a traceback, restarted as a
    FAILED job. The supervisor's own variables are its options' (``--term-timeout``...)."""
    from ..checkpoint._interval import mtbf_from_env
    from ..distributed._agreement import dist_poll
    from ..distributed._group import dist_timeout
    from ..notices import check_env

    check_env()  # platform, grace period, poll interval, endpoints, stop file
    mtbf_from_env()
    dist_timeout()
    dist_poll()


BUCKET_CHECK_SECONDS = 15.0
"""How long ``preemptible run`` waits for a checkpoint URL's bucket to answer at its start."""


def check_bucket(url: str) -> None:
    """A checkpoint URL whose bucket does not exist or refuses the credentials is one line
    (``ConfigError``) before any attempt starts, as the job's own start would raise it after a
    traceback, and the supervisor then offer to resume from that very bucket. Anything that may
    pass by itself (no answer within ``BUCKET_CHECK_SECONDS``, unreachable) is the job's to
    meet, with its retries: said in one line here, not refused."""
    from ..checkpoint._location import Location
    from ..checkpoint._mirror import probe

    location = Location.parse(url)
    if location.is_local:
        return
    problem = probe(location, BUCKET_CHECK_SECONDS)
    if problem is None:
        return
    if isinstance(problem, ConfigError) or (
        isinstance(problem, CheckpointRemoteError) and problem.reason in ("missing", "refused")
    ):
        raise ConfigError(str(problem)) from None
    logger.warning("preemptible: %s; the job will try again itself", problem)


def attempt_environment(
    number: int,
    attempt_dir: Path,
    *,
    run_id: str,
    config: SupervisorConfig,
    checkpoint_dir: Path | str,
    nested: bool,
    journal: Path,
    resumes: Resumes,
    kill_after: float,
) -> dict[str, str]:
    """The environment attempt ``number`` of run ``run_id`` starts with: this process's,
    plus what the attempt is told (see the module docstring)."""
    env = dict(os.environ)
    env.update(
        PREEMPTIBLE_RUN_ID=run_id,
        PREEMPTIBLE_ATTEMPT=str(number),
        PREEMPTIBLE_RUN_DIR=str(attempt_dir.resolve()),
        PREEMPTIBLE_CHECKPOINT_DIR=(
            checkpoint_dir if isinstance(checkpoint_dir, str) else str(checkpoint_dir.resolve())
        ),
    )
    # Not given: the handler may keep its own directory without a warning. A nested run
    # that took its parent's default directory from the environment passes that on.
    outer = current_run()  # this supervisor's own run, when it is nested
    outer_dir = outer.checkpoint_url or outer.checkpoint_dir
    inherited = outer.checkpoint_dir_default and (str(checkpoint_dir) == str(outer_dir))
    if config.checkpoint_dir is None or (nested and inherited):
        env["PREEMPTIBLE_CHECKPOINT_DIR_DEFAULT"] = "1"
    else:
        env.pop("PREEMPTIBLE_CHECKPOINT_DIR_DEFAULT", None)
    # nested: the outer supervisor's SIGKILL reaches this attempt's processes too
    if outer.kill_after is not None:
        kill_after = min(kill_after, outer.kill_after)
    env["PREEMPTIBLE_KILL_AFTER"] = f"{kill_after:.3f}"
    env.setdefault("PET_SIGNALS_TO_HANDLE", ELASTIC_SIGNALS)
    # the agent's own SIGKILL of its workers no earlier than the supervisor's (torch: 30 s)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(math.ceil(kill_after)))
    env.pop("PREEMPTIBLE_RESUME_FROM", None)
    env.update(config.extra_env)
    exits = measured_exits(journal)
    if exits:
        # the worst of the last few: one fast exit must not shrink the budget of the next
        env[EXIT_SECONDS_ENV] = f"{max(exits):.3f}"
    try:
        latest = resumes.target()
    except OSError as exc:
        where = resumes.directory
        problem = not_a_directory(where) if isinstance(where, Path) else None
        if problem:  # "Not a directory" alone names neither the file nor what to do
            raise ConfigError(
                f"checkpoint directory: {problem}; give --checkpoint-dir "
                "(PREEMPTIBLE_CHECKPOINT_DIR) a directory"
            ) from exc
        raise PreemptibleError(
            f"cannot read the checkpoint directory {resumes.directory}: {exc.strerror or exc}"
        ) from exc
    if latest is not None:
        env["PREEMPTIBLE_RESUME_FROM"] = str(latest.resolve())
    return env


def tell_parent(run_id: str, last_attempt_dir: Path, parent_dir: Path, files: RunFiles) -> None:
    """A nested run ends: its last attempt's record becomes the record of the parent's
    attempt ``parent_dir`` (proven ours: ``_parent.py``), so that the parent classifies what
    really happened (a preemption, not a bare exit code) and resumes from the same
    checkpoints."""
    record = {k: v for k, v in read_record(last_attempt_dir).items() if k in PASSED_UP}
    record.update(nested_run=run_id, pid=os.getpid(), updated_at=time.time())
    path = parent_dir / RECORD_NAME
    try:
        write_text_atomic(path, json.dumps(record, indent=1), durable=True)
    except OSError as exc:
        files.warn_once("parent record", path, exc)
