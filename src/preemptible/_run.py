"""The run record: what this attempt tells its supervisor, out of band from the exit code.

A supervisor (``preemptible run``, ``preemptible agent``) gives each attempt a run
directory through ``PREEMPTIBLE_RUN_DIR``. The training side writes ``record.json`` there
when it stops early or marks itself as preempting, so that an exit code of 0 from a wrapper
shell or a framework that swallows signals cannot make a preempted run look finished.
Without a supervisor the record is simply not written.

The record is best effort: a run directory that is read-only, vanished, under a regular file,
or holds an odd ``record.json`` costs a warning, never the checkpoint or the exit code.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._env import env_str
from ._files import write_text_atomic
from ._paths import RECORD_NAME, read_json_object
from ._states import STOPPED_EARLY, RecordState

logger = logging.getLogger("preemptible")

MAX_RECORD_BYTES = 1 << 20
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # scheme://: checkpoint/_location's test
_warned = False
_updating = threading.Lock()  # a read-merge-write: two threads (a watcher's) must not interleave


@dataclass(frozen=True)
class RunInfo:
    """What the supervisor passed to this attempt (all None without a supervisor)."""

    run_id: str | None
    attempt: int | None
    run_dir: Path | None
    checkpoint_dir: Path | None  # None when the supervisor gave a URL: see checkpoint_url
    resume_from: Path | None
    checkpoint_dir_default: bool = False  # the supervisor chose checkpoint_dir (none was given)
    # PREEMPTIBLE_CHECKPOINT_DIR when it is a URL (s3://, gs://, az://, as given): checkpoints
    # live in a bucket, which no local path names
    checkpoint_url: str | None = None
    # PREEMPTIBLE_KILL_AFTER: seconds from a stop the supervisor passes on to its SIGKILL of the
    # attempt's group (its term timeout); what a stop without a deadline of its own can count on
    kill_after: float | None = None

    @property
    def supervised(self) -> bool:
        return self.run_dir is not None


def _path_env(name: str) -> Path | None:
    value = env_str(name)
    return Path(value) if value else None


def current_run() -> RunInfo:
    """The ids and paths the supervisor gave this attempt, read from the environment: the
    one reader of the variables a supervisor sets for its attempts (a test checks)."""
    attempt = (env_str("PREEMPTIBLE_ATTEMPT") or "").strip()
    valid = attempt.isascii() and attempt.isdecimal() and len(attempt) <= 9
    where = env_str("PREEMPTIBLE_CHECKPOINT_DIR")
    # a URL is kept as given (Path() would fold its "//" away); the kit checks it
    # (checkpoint_directory), which this base module does not import
    url = where if where and _URL.match(where) else None
    return RunInfo(
        run_id=env_str("PREEMPTIBLE_RUN_ID"),
        attempt=int(attempt) if valid else None,
        run_dir=_path_env("PREEMPTIBLE_RUN_DIR"),
        checkpoint_dir=Path(where) if where and url is None else None,
        resume_from=_path_env("PREEMPTIBLE_RESUME_FROM"),
        checkpoint_dir_default=env_str("PREEMPTIBLE_CHECKPOINT_DIR_DEFAULT") == "1",
        checkpoint_url=url,
        kill_after=_seconds_env("PREEMPTIBLE_KILL_AFTER"),
    )


def _seconds_env(name: str) -> float | None:
    """A positive finite number of seconds, or None (unset or not one: the supervisor writes
    it, so anything else is not from a supervisor and is ignored rather than refused)."""
    try:
        value = float(env_str(name) or "nan")
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def read_record(run_dir: Path) -> dict[str, Any]:
    """The record as written, or {} when it is missing or unreadable. The values are whatever
    the child wrote: a reader that acts on them checks their types."""
    return read_json_object(run_dir / RECORD_NAME, MAX_RECORD_BYTES)


def update_record(**fields: Any) -> Path | None:
    """Merge ``fields`` into this attempt's record (atomically); None without a supervisor,
    or when the record cannot be written (logged once: the record is best effort)."""
    run_dir = current_run().run_dir
    if run_dir is None:
        return None
    try:
        with _updating:
            return _update(run_dir, fields)
    except (OSError, ValueError, TypeError) as exc:
        global _warned
        if not _warned:
            _warned = True
            logger.warning(
                "preemptible: cannot write the run record in %s (%s: %s); the supervisor may "
                "misreport this attempt, the checkpoint is not affected",
                run_dir,
                type(exc).__name__,
                exc,
            )
        return None


def _update(run_dir: Path, fields: dict[str, Any]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    record = read_record(run_dir)
    now = time.time()
    # First times are kept: the supervisor compares them with its own signals to tell a run
    # marked preemptible from the start from one marked while it was being stopped.
    if fields.get("preempting") and "preempting_at" not in record:
        record["preempting_at"] = now
    if fields.get("state") in STOPPED_EARLY and "stopped_at" not in record:
        record["stopped_at"] = now
    if fields.get("state") == RecordState.STOPPED:
        # the final checkpoint is committed: the exit starts here (the supervisor measures it
        # to the moment the process is gone, and budgets that for the next attempt's exit)
        record["committed_at"] = now
    record.update(fields, pid=os.getpid(), updated_at=now)
    path = run_dir / RECORD_NAME
    write_text_atomic(path, json.dumps(record, indent=1, default=str), durable=True)
    return path


def mark_preempting() -> None:
    """Tell the supervisor that this run is being preempted (W&B's meaning): a non-zero exit
    or a death by signal from now on is a preemption, not a failure."""
    update_record(preempting=True)
