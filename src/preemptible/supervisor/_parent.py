"""Whether a ``preemptible run`` is nested in an attempt of another run, proven, not assumed.

A supervisor tells each attempt ``PREEMPTIBLE_RUN_ID`` and ``PREEMPTIBLE_RUN_DIR``, and a
``preemptible run`` started inside that attempt is a nested run: its id is derived from the
parent's, and when it ends it writes its last record into the parent's attempt directory, for
the parent to classify. But the environment outlives the attempt: a shell that kept those
variables (an ``export`` copied from a job script, a terminal opened inside a job) made a
``preemptible run`` there treat itself as nested and replace another run's ``record.json``.

So the environment only names a candidate. Before an attempt's job starts, its supervisor
writes ``attempt-N/supervisor.json``: the run, the attempt number, and the supervisor's own
pid with its start time (the pid alone could be reused). A run is nested only when the
directory the environment names holds that file, it names the same run and attempt, and that
supervisor is alive and an ancestor of this process (the supervisor is a subreaper, so a
job's daemons stay its descendants). Anything else is a run of its own, said in one line, and
nothing is written in that directory. A nested run behind a pid namespace of its own (the job
ran ``unshare --pid``) cannot see its parent and is a run of its own too.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .._files import write_text_atomic
from .._paths import ATTEMPT_PREFIX, OWNER_NAME, read_json_object
from .._run import current_run
from ._guard import read_proc

_MAX_OWNER_BYTES = 4096
_MAX_DEPTH = 4096  # ancestors looked at: more than any real process tree


@dataclass(frozen=True)
class Parent:
    """The run whose attempt this process is part of, and that attempt's directory."""

    run_id: str
    attempt_dir: Path


def mark_attempt(attempt_dir: Path, run_id: str, number: int) -> None:
    """Write who made ``attempt_dir`` (this supervisor), before its job starts. Raises
    OSError; without the file a run started inside the attempt is a run of its own."""
    me = read_proc(os.getpid())
    owner = {
        "run_id": run_id,
        "attempt": number,
        "pid": os.getpid(),
        "start": me.start if me is not None else None,
    }
    write_text_atomic(attempt_dir / OWNER_NAME, json.dumps(owner) + "\n")


def find_parent() -> tuple[Parent | None, str]:
    """(the parent attempt, "") when this process is part of the attempt its environment
    names; (None, why not) when the environment names one that is not ours; (None, "") when
    it names none."""
    run = current_run()
    if run.run_dir is None:
        return None, ""
    why = _not_ours(run.run_dir, run.run_id, run.attempt)
    if why:
        return None, why
    assert run.run_id is not None  # _not_ours checked it
    return Parent(run.run_id, run.run_dir), ""


def _not_ours(attempt_dir: Path, run_id: str | None, attempt: int | None) -> str:
    """Why ``attempt_dir`` is not an attempt this process is part of; "" when it is."""
    if not attempt_dir.is_absolute():
        return "it is not an absolute path"
    if run_id is None or attempt is None or attempt_dir.name != f"{ATTEMPT_PREFIX}{attempt}":
        return "PREEMPTIBLE_RUN_ID and PREEMPTIBLE_ATTEMPT do not name it"
    owner = read_json_object(attempt_dir / OWNER_NAME, _MAX_OWNER_BYTES)
    pid, start = owner.get("pid"), owner.get("start")
    if not owner:
        return f"it holds no {OWNER_NAME} of a supervisor"
    if owner.get("run_id") != run_id or owner.get("attempt") != attempt:
        return f"its supervisor made it for run {owner.get('run_id')!r}, not {run_id!r}"
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(start, int):
        return f"its {OWNER_NAME} names no supervisor"
    proc = read_proc(pid)
    if proc is None or proc.zombie or proc.start != start:
        return f"its supervisor (pid {pid}) is gone"
    if not _is_ancestor(pid):
        return f"its supervisor (pid {pid}) is not an ancestor of this process"
    return ""


def _is_ancestor(pid: int) -> bool:
    current = os.getppid()
    for _ in range(_MAX_DEPTH):
        if current == pid:
            return True
        if current <= 1:
            return False
        proc = read_proc(current)
        if proc is None:
            return False
        current = proc.ppid
    return False
