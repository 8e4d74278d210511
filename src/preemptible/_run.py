"""The run record: what this attempt tells its supervisor, out of band from the exit code.

A supervisor (``preemptible run``, ``preemptible agent``) gives each attempt a run
directory through ``PREEMPTIBLE_RUN_DIR``. The training side writes ``record.json`` there
when it stops early or marks itself as preempting, so that an exit code of 0 from a wrapper
shell or a framework that swallows signals cannot make a preempted run look finished.
Without a supervisor the record is simply not written.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._checkpoint import fsync_dir

RECORD_NAME = "record.json"


@dataclass(frozen=True)
class RunInfo:
    """What the supervisor passed to this attempt (all None without a supervisor)."""

    run_id: str | None
    attempt: int | None
    run_dir: Path | None
    checkpoint_dir: Path | None
    resume_from: Path | None

    @property
    def supervised(self) -> bool:
        return self.run_dir is not None


def _path_env(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def current_run() -> RunInfo:
    """The ids and paths the supervisor gave this attempt, read from the environment."""
    attempt = os.environ.get("PREEMPTIBLE_ATTEMPT")
    return RunInfo(
        run_id=os.environ.get("PREEMPTIBLE_RUN_ID") or None,
        attempt=int(attempt) if attempt and attempt.isdigit() else None,
        run_dir=_path_env("PREEMPTIBLE_RUN_DIR"),
        checkpoint_dir=_path_env("PREEMPTIBLE_CHECKPOINT_DIR"),
        resume_from=_path_env("PREEMPTIBLE_RESUME_FROM"),
    )


def read_record(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / RECORD_NAME).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def update_record(**fields: Any) -> Path | None:
    """Merge ``fields`` into this attempt's record (atomically); None without a supervisor."""
    run_dir = current_run().run_dir
    if run_dir is None:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    record = read_record(run_dir)
    now = time.time()
    # First times are kept: the supervisor compares them with its own signals to tell a run
    # marked preemptible from the start from one marked while it was being stopped.
    if fields.get("preempting") and "preempting_at" not in record:
        record["preempting_at"] = now
    if fields.get("state") in ("stopping", "stopped") and "stopped_at" not in record:
        record["stopped_at"] = now
    record.update(fields, pid=os.getpid(), updated_at=now)
    path = run_dir / RECORD_NAME
    tmp = run_dir / f".{RECORD_NAME}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(record, fh, indent=1, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(run_dir)
    return path


def mark_preempting() -> None:
    """Tell the supervisor that this run is being preempted (W&B's meaning): a non-zero exit
    or a death by signal from now on is a preemption, not a failure."""
    update_record(preempting=True)
