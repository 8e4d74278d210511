"""``preemptible runs``: what became of the runs ``preemptible run`` supervised under a home.

Everything is read from the run directories, never written: the attempts journal (the last
attempt's state, exit code and end), the heartbeat (a supervisor at work, or one that ended)
and the kernel's lock table (``/proc/locks``): a supervisor holds ``supervisor.lock`` with
``flock`` for as long as it lives, so a heartbeat that says "running" without that lock is a
supervisor that was killed before it could say anything else (LOST). The lock is looked up,
not taken: taking it, even shared and for a moment, could turn away a supervisor starting.
Every file is read non-blocking, bounded and checked, as all inputs written by jobs are.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from .._errors import PreemptibleError
from .._files import file_id, held_flocks
from .._paths import RunPaths, read_journal, read_json_object
from .._states import Ending, HeartbeatState, LiveState, RunState, parse
from ..checkpoint._location import is_url
from ..checkpoint._store import _FINAL as STEP_NAME
from ..checkpoint._store import CheckpointStore
from ._journal import JOURNAL_TAIL_BYTES
from ._record import _int, _time, load_record

_MAX_RUNS = 10_000


def list_runs(home: Path) -> list[dict[str, Any]]:
    """One row per run directory under ``home/runs``, newest activity first."""
    runs = home / "runs"
    try:
        entries = sorted(os.scandir(runs), key=lambda e: e.name)[:_MAX_RUNS]
    except OSError:
        return []
    held = held_flocks()
    rows = [_row(Path(e.path), held) for e in entries if e.is_dir(follow_symlinks=False)]
    return sorted(rows, key=lambda r: r["updated_at"] or 0.0, reverse=True)


def _row(run_dir: Path, held: set[tuple[int, int, int]]) -> dict[str, Any]:
    run = RunPaths(run_dir)
    attempts = [a for a in read_journal(run.journal, JOURNAL_TAIL_BYTES) if a]
    last = attempts[-1] if attempts else {}
    beat = read_json_object(run.heartbeat, 1 << 14)
    running = _is_held(run.lock, held)
    state: str | None = parse(RunState, last.get("state"))
    number = _int(last.get("attempt"), 1, 2**31)
    if state is not None and number is not None:
        # a sweep agent's ending of the attempt where it differs from the supervisor's (an
        # early-terminated run exits as preempted; the queue has it STOPPED)
        state = parse(Ending, read_json_object(run.ending(number), 1 << 12).get("ending")) or state
    if running:
        state = LiveState.RUNNING
    elif beat.get("state") == HeartbeatState.RUNNING:
        state = LiveState.LOST  # its supervisor died without a word (SIGKILL, a machine gone)
    numbers = [_int(a.get("attempt"), 1, 2**31) for a in attempts]
    return {
        "run_id": run_dir.name,
        "state": state or LiveState.UNKNOWN,
        "attempts": max([n for n in numbers if n is not None] + [run.newest_attempt()]),
        "exit_code": _int(last.get("exit_code"), -(2**31), 2**31),
        "ending": last.get("ending") if isinstance(last.get("ending"), str) else None,
        "updated_at": max(
            (t for t in (_time(last.get("ended_at")), _time(beat.get("at"))) if t is not None),
            default=None,
        ),
        "checkpoint": _newest_checkpoint(run),
    }


def _newest_checkpoint(run: RunPaths) -> str | None:
    """The newest ``step-N.ckpt`` where the run's attempts said they save (their record),
    else in the run's own checkpoint directory; or the checkpoint of another name the newest
    attempt's record says it committed. Looked up, never created. In a bucket: the newest
    checkpoint the record says reached it, else the newest it committed (in staging)."""
    places = [run.checkpoints]
    newest = run.newest_attempt()
    named: Path | None = None  # the newest checkpoint of any name its record gives
    if newest:
        record = load_record(run.attempt(newest))
        where = record.checkpoint_dir
        if where is not None and is_url(where):  # in a bucket: what the record says is there
            return record.remote_checkpoint or record.resume_from or where
        if where is not None and os.path.isabs(where):
            places.insert(0, Path(where))
            if record.resume_from is not None and Path(record.resume_from).parent == Path(where):
                named = Path(record.resume_from)
    if named is not None and not STEP_NAME.match(named.name) and os.path.lexists(named):
        return str(named)  # a framework's own name (Lightning's resume.ckpt)
    for place in places:
        try:
            latest = CheckpointStore(place, create=False).latest()
        except (OSError, PreemptibleError):
            continue
        if latest is not None:
            return str(latest.path)
    return None


def _is_held(lock: Path, held: set[tuple[int, int, int]]) -> bool:
    try:
        st = os.lstat(lock)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return False
    return file_id(st) in held


def render_runs(rows: list[dict[str, Any]], now: float) -> Any:
    """A rich table of ``list_runs`` rows."""
    from rich.table import Table
    from rich.text import Text

    from .._text import format_age, printable

    table = Table(box=None, header_style="bold")
    for name in ("run", "state", "attempts", "exit", "last seen", "newest checkpoint"):
        table.add_column(name, no_wrap=name != "newest checkpoint")
    colors = {
        RunState.FINISHED: "green",
        LiveState.RUNNING: "cyan",
        RunState.PREEMPTED: "yellow",
        Ending.STOPPED: "blue",
        RunState.FAILED: "red",
    }
    for r in rows:
        seen = None if r["updated_at"] is None else max(0.0, now - r["updated_at"])
        table.add_row(
            Text(printable(r["run_id"])),
            Text(r["state"], style=colors.get(r["state"], "magenta")),
            str(r["attempts"]),
            "" if r["exit_code"] is None else str(r["exit_code"]),
            Text(format_age(seen) + (" ago" if seen is not None else "")),
            Text(printable(r["checkpoint"] or "none")),
        )
    if not rows:
        table.add_row("", Text("no runs here yet", style="dim"), "", "", "", "")
    return table
