"""How an attempt ended: FINISHED, FAILED, PREEMPTED, KILLED or CRASHED.

The exit status alone lies in both directions: a wrapper shell exits 0 after its preempted
child, a framework exits 0 after it saved on SIGTERM, and a run that was killed because the
machine went away looks like any other crash. Two more witnesses make it exact: the run record
written by the training side (``PREEMPTIBLE_RUN_DIR/record.json``), and what the supervisor
itself did to the attempt, which it knows for certain. The table (DESIGN.md):

| how the attempt ended | no mark  | marked while stopping | marked at start | a stop ended it ** |
|-----------------------|----------|-----------------------|-----------------|--------------------|
| exit 0                | FINISHED | FINISHED *            | FINISHED *      | FINISHED *         |
| exit non-zero         | FAILED   | PREEMPTED             | PREEMPTED       | PREEMPTED          |
| SIGKILL               | CRASHED  | CRASHED               | PREEMPTED       | PREEMPTED          |
| lost                  | CRASHED  | CRASHED               | PREEMPTED       | -                  |
| SIGINT                | KILLED   | PREEMPTED             | PREEMPTED       | PREEMPTED          |
| another signal        | CRASHED  | PREEMPTED             | PREEMPTED       | PREEMPTED          |

* PREEMPTED when the record says the run stopped early (state "stopping"/"stopped").

** The last column wins over the marks. A stop of the attempt is a signal of the stop set
that the supervisor received while the attempt ran (passed on to the job's process group, or
left to the platform under ``--no-forward-signals``), or a stop asked for through
``Supervisor.stop_job`` (a sweep's ``cancel``, the early-termination judge, the agent's lease).
After one, the attempt is PREEMPTED when it exits non-zero, when it dies by one of those
signals, and when it dies by a SIGKILL the supervisor sent itself (its escalation a term
timeout after the stop, or a SIGKILL asked for). Where the stop landed does not matter: before
the program's handler existed (imports, building the model), in its loop, during its save, or
after its loop (writing results, an export, with the handler gone): the supervisor *knows* it
stopped the attempt, and the same Ctrl+C must not requeue a run inside its loop and end it for
good a second earlier. The next attempt resumes from the newest checkpoint (the plain handler
commits the last step as its loop ends, so a stop after the loop trains no step again). A
death by any other signal (the OOM killer's SIGKILL, a segfault, a ``kill`` from elsewhere to
the program alone) is not the stop's doing, and nobody saw how a lost attempt ended: the
columns to the left apply.

This replaced a rule that followed W&B's table for a run without ``mark_preempting``: a job
that died of a signal the supervisor had passed on was classed as if killed by it (KILLED for
SIGINT, CRASHED otherwise), so a sweep run stopped during its start-up was over for good under
the default ``max_failures: 0``, and ``preemptible run`` under SLURM did not requeue it.

A run whose stop raised while saving (record state "save_failed") and then exited non-zero is
FAILED whatever the column: it did not keep the stop's promise of a checkpoint, and its tracker
says "failed" too. Cut short by a second signal or a kill, the save is not a failure: the
table applies.

"Marked at start" means ``mark_preempting()`` was called before any stop began: before the
handler started stopping and before the supervisor passed on a signal. Such a run declared
that any disappearance is a preemption (a spot-instance job, W&B's meaning).

The record is the job's word (``RunRecord``, checked on read); only the exit status can make
an attempt FINISHED, so no record turns a failure into the supervisor's exit code 0. What a
sweep run becomes is the queue's to say (``sweeps/store/_endings.py``): in a cancelled sweep every
ending but FINISHED ends the run CANCELLED, a ``cancel --now`` (a SIGKILL asked for) included.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import ConfigError
from .._states import RecordState, RunState, StrState
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
    stops: Collection[int] = (),
    killed: bool = False,
) -> RunState:
    """The attempt's state (the table above). ``first_signal_at``: wall time of the first stop
    signal the supervisor received; ``stops``: the signals of the stops the supervisor received
    or was asked for during the attempt; ``killed``: the supervisor SIGKILLed the attempt
    itself (its escalation, or a SIGKILL asked for)."""
    rec = as_record(record)
    kind = mark_kind(rec, first_signal_at)
    if ending.exit_code == 0:
        return RunState.PREEMPTED if rec.stopped_early else RunState.FINISHED
    if rec.state is RecordState.SAVE_FAILED and ending.exit_code is not None:
        return RunState.FAILED  # its stop raised instead of committing: say so, like its tracker
    if kind is Mark.START or ended_by_stop(ending, stops, killed=killed):
        return RunState.PREEMPTED
    if ending.lost or ending.signal == signal.SIGKILL:
        return RunState.CRASHED
    if kind is Mark.STOPPING:
        return RunState.PREEMPTED
    if ending.exit_code is not None:
        return RunState.FAILED
    return RunState.KILLED if ending.signal == signal.SIGINT else RunState.CRASHED


def ended_by_stop(ending: Ending, stops: Collection[int], *, killed: bool) -> bool:
    """Whether a stop of the supervisor's ended the attempt (the table's last column): after
    one, a non-zero exit, a death by one of its signals, or by the supervisor's own SIGKILL."""
    if not stops or ending.lost:
        return False
    if ending.exit_code is not None:
        return ending.exit_code != 0
    return ending.signal in stops or (killed and ending.signal == signal.SIGKILL)


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
    # CRASHED: a death by a signal nobody passed on, or lost
    if ending.signal is not None:
        return signal_exit_code(ending.signal)
    return signal_exit_code(signal.SIGKILL)  # lost
