"""The one state vocabulary of preemptible, and the one rule for spending restart budgets.

Every state a run, an attempt, a run record, a heartbeat or a sweep can be in is named here
once; the classifier, ``preemptible run``'s restart policy, the sweep queue (and the ``CHECK``
constraints of its SQL schema, which a test holds to these enums), ``preemptible status`` and
``preemptible runs``, the agent and the checkpoint-interval estimator use these names.

    RunState       how an attempt ended, as the supervisor classifies it (and so the run)
    QueueState     a sweep run in the queue: PENDING, RUNNING, or where it ended
    Ending         an attempt of a sweep run as the queue records it (RunState, CANCELLED,
                   RELEASED, STOPPED)
    RecordState    what the training process wrote in its run record (record.json)
    HeartbeatState what the supervisor wrote in its heartbeat
    LiveState      what ``preemptible runs`` shows for a run without an ending
    Control        what a sweep was told: running, stopped, paused, cancelled

All are ``str`` enums (``StrState``): a member equals its value, so values read back from JSON
or a database compare equal to the members, and a member is written as its plain value.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, TypeVar


class StrState(str, enum.Enum):
    """A state: a ``str`` that prints as its value (``enum.StrEnum`` from Python 3.11 on)."""

    def __str__(self) -> str:
        return str(self.value)


S = TypeVar("S", bound=StrState)


class RunState(StrState):
    """How an attempt ended (DESIGN.md: the end-state table)."""

    FINISHED = "FINISHED"
    FAILED = "FAILED"
    PREEMPTED = "PREEMPTED"
    KILLED = "KILLED"
    CRASHED = "CRASHED"


class QueueState(StrState):
    """A sweep run in the queue."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    PREEMPTED = "PREEMPTED"
    KILLED = "KILLED"
    CRASHED = "CRASHED"
    CANCELLED = "CANCELLED"
    STOPPED = "STOPPED"  # ended by early termination (Hyperband), checkpointed: resumable


FINAL_QUEUE_STATES = frozenset(QueueState) - {QueueState.PENDING, QueueState.RUNNING}


class Ending(StrState):
    """An attempt's ending as the queue records it: a RunState, or what the agent did."""

    FINISHED = "FINISHED"
    FAILED = "FAILED"
    PREEMPTED = "PREEMPTED"
    KILLED = "KILLED"
    CRASHED = "CRASHED"
    CANCELLED = "CANCELLED"  # the sweep was cancelled while the attempt ran
    RELEASED = "RELEASED"  # a stopping agent handed the run back (not the run's doing)
    STOPPED = "STOPPED"  # early termination stopped it (it saved and exited as preempted)


class RecordState(StrState):
    """The ``state`` a training process writes in its run record."""

    STOPPING = "stopping"  # a stop was decided; the checkpoint is being written
    STOPPED = "stopped"  # the stop's checkpoint is committed
    SAVE_FAILED = "save_failed"  # the stop's checkpoint could not be written
    FINISHED = "finished"  # training ended on its own


STOPPED_EARLY = frozenset({RecordState.STOPPING, RecordState.STOPPED})


class HeartbeatState(StrState):
    """The ``state`` of a supervisor's heartbeat file."""

    RUNNING = "running"
    ENDED = "ended"


class LiveState(StrState):
    """What ``preemptible runs`` shows for a run that has no ending (else its RunState)."""

    RUNNING = "RUNNING"  # its supervisor holds the run's lock
    LOST = "LOST"  # its heartbeat says running, but no supervisor holds the lock
    UNKNOWN = "UNKNOWN"  # nothing readable says either


class Control(StrState):
    """What a sweep was told (``preemptible sweep stop/pause/resume/cancel``)."""

    RUNNING = "running"
    STOPPED = "stopped"
    PAUSED = "paused"
    CANCELLED = "cancelled"


def parse(kind: type[S], value: object) -> S | None:
    """``value`` as a member of ``kind`` when it is exactly one of its values, else None
    (whatever was read from a file or a database: any type)."""
    if isinstance(value, str):
        for member in kind:
            if member.value == value:
                return member
    return None


class Spent(NamedTuple):
    """The budgets after an attempt: whether another attempt may start, and the counts."""

    again: bool
    preemptions: int
    failures: int
    preempted: bool  # the attempt counted against the preemption budget (else the failures)


def spend(
    *,
    preempted: bool,
    preemptions: int,
    failures: int,
    max_preemptions: int | None,
    max_failures: int,
) -> Spent:
    """The one restart rule, for ``preemptible run`` and the sweep queue alike.

    An attempt that was preempted (not the run's fault) spends the preemption budget, any
    other unfinished one the failure budget; another attempt may start while the spent count
    stays within its maximum (``max_preemptions=None``: no limit). Budgets are separate: a run
    preempted a hundred times has not failed once."""
    if preempted:
        preemptions += 1
        again = max_preemptions is None or preemptions <= max_preemptions
    else:
        failures += 1
        again = failures <= max_failures
    return Spent(again, preemptions, failures, preempted)
