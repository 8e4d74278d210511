"""How an attempt ended: FINISHED, FAILED, PREEMPTED, KILLED or CRASHED.

The exit status alone lies in both directions: a wrapper shell exits 0 after its preempted
child, a framework exits 0 after it saved on SIGTERM, and a run that was killed because the
machine went away looks like any other crash. The run record written by the training side
(``PREEMPTIBLE_RUN_DIR/record.json``) says what really happened, and this table combines
the two (DESIGN.md):

| how the attempt ended      | no mark    | marked while stopping | marked at start |
|----------------------------|------------|-----------------------|-----------------|
| exit 0                     | FINISHED   | FINISHED *            | FINISHED *      |
| exit non-zero              | FAILED **  | PREEMPTED             | PREEMPTED       |
| SIGKILL / lost             | CRASHED    | CRASHED               | PREEMPTED       |
| SIGINT                     | KILLED     | PREEMPTED             | PREEMPTED       |
| other signal (TERM, USR1…) | CRASHED    | PREEMPTED             | PREEMPTED       |

* PREEMPTED when the record says the run stopped early (state "stopping"/"stopped").

A run whose stop raised while saving (record state "save_failed") and then exited non-zero is
FAILED whatever the column: it did not keep the stop's promise of a checkpoint, and its tracker
says "failed" too. Cut short by a second signal or a kill, the save is not a failure: the
table applies.

** Unless the supervisor had passed a stop signal on to the attempt: then the ending is
classified as if the job had died by that signal (KILLED for SIGINT, CRASHED otherwise). Many
programs exit 1 or 2 on SIGTERM or Ctrl+C; the run did not fail, it was stopped, and a
FAILED attempt would use up the failure budget and restart on a machine that is going away.

"Marked at start" means ``mark_preempting()`` was called before any stop began: before the
handler started stopping and before the supervisor passed on a signal. Such a run declared
that any disappearance is a preemption (a spot-instance job, W&B's meaning).

The record is the job's word (``RunRecord``, checked on read); only the exit status can make
an attempt FINISHED, so no record turns a failure into the supervisor's exit code 0.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import ConfigError
from .._states import RecordState, StrState
from .._states import RunState as RunState  # importable from here, as before
from ..stop._termination import signal_exit_code
from ._record import RunRecord


@dataclass(frozen=True)
class Ending:
    """The direct child's end: an exit code, a death signal, or lost (nobody saw it end)."""

    exit_code: int | None = None
    signal: int | None = None
    lost: bool = False

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.exit_code, self.signal)) + self.lost != 1:
            raise ConfigError("an Ending has exactly one of exit_code, signal, lost")

    def describe(self) -> str:
        if self.lost:
            return "lost"
        if self.signal is not None:
            return f"killed by {_signame(self.signal)}"
        return f"exit {self.exit_code}"


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def as_record(record: RunRecord | Mapping[str, Any]) -> RunRecord:
    return record if isinstance(record, RunRecord) else RunRecord.from_json(dict(record))


class Mark(StrState):
    """When the run marked itself as preempting: the table's three columns."""

    NONE = "none"  # never
    STOPPING = "stopping"  # while it was being stopped
    START = "start"  # before any stop began: preemptible from the start


def mark_kind(record: RunRecord | Mapping[str, Any], first_signal_at: float | None) -> Mark:
    """Which of the table's three columns the record puts the attempt in."""
    rec = as_record(record)
    if rec.preempting_at is None and not rec.stopped_early:
        return Mark.NONE
    stop_began = min(
        (t for t in (rec.stopped_at, first_signal_at) if t is not None), default=math.inf
    )
    if rec.preempting_at is not None and rec.preempting_at < stop_began:
        return Mark.START
    return Mark.STOPPING


def classify(
    ending: Ending,
    record: RunRecord | Mapping[str, Any],
    *,
    first_signal_at: float | None = None,
    forwarded: int | None = None,
) -> RunState:
    """The attempt's state (the table above). ``first_signal_at``: wall time of the first stop
    signal the supervisor received; ``forwarded``: the first signal it passed on, if any."""
    rec = as_record(record)
    kind = mark_kind(rec, first_signal_at)
    if ending.exit_code == 0:
        return RunState.PREEMPTED if rec.stopped_early else RunState.FINISHED
    if rec.state is RecordState.SAVE_FAILED and ending.exit_code is not None:
        return RunState.FAILED  # its stop raised instead of committing: say so, like its tracker
    if kind is Mark.START:
        return RunState.PREEMPTED
    if ending.lost or ending.signal == signal.SIGKILL:
        return RunState.CRASHED
    if kind is Mark.STOPPING:
        return RunState.PREEMPTED
    died_by = ending.signal if ending.exit_code is None else forwarded
    if died_by is None:
        return RunState.FAILED
    return RunState.KILLED if died_by == signal.SIGINT else RunState.CRASHED


def exit_code_for(
    state: RunState, ending: Ending, record: RunRecord | Mapping[str, Any], stop: int | None
) -> int:
    """The supervisor's own exit code for an attempt that ended in ``state``; ``stop`` is the
    first stop signal the supervisor received during the attempt. Only FINISHED gives 0."""
    if state is RunState.FINISHED:
        return 0
    if state is RunState.FAILED:
        return ending.exit_code or 1
    if state is RunState.KILLED:
        return signal_exit_code(signal.SIGINT)
    if state is RunState.PREEMPTED:
        signum = as_record(record).signum or stop or ending.signal
        if signum is None and ending.exit_code is not None and 128 < ending.exit_code < 160:
            return ending.exit_code  # already 128 + signum, from a program of its own
        return signal_exit_code(signum or None)
    # CRASHED
    if ending.signal is not None:
        return signal_exit_code(ending.signal)
    if ending.exit_code is not None and stop is not None:
        return signal_exit_code(stop)  # exited after the stop was passed on: as if it died by it
    return signal_exit_code(signal.SIGKILL)  # lost
