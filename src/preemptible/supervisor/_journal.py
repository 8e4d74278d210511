"""The attempts of a run and their journal (``attempts.jsonl``): one JSON line per attempt
that ended, appended by its supervisor, read back by the next supervisor of the run (the exit
times it measured), ``preemptible runs`` and the checkpoint interval (the run's history)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from .._files import open_in_place
from .._paths import read_journal
from .._run import read_record
from .._states import RecordState, RunState
from ..stop._signals import signal_name
from ._classify import Ending
from ._record import _time

JOURNAL_TAIL_BYTES = 1 << 16  # the journal's last attempts; a line is ~300 bytes
EXIT_HISTORY = 3  # measured exits passed on: the next attempt budgets the longest of these


class Received(NamedTuple):
    """A signal the supervisor got: which, when (wall time), and whether it was passed on."""

    signum: int
    at: float
    forwarded: bool


@dataclass
class Attempt:
    number: int
    pid: int
    state: RunState
    ending: Ending
    exit_code: int
    duration: float
    signals: list[Received] = field(default_factory=list)
    killed: bool = False  # the supervisor SIGKILLed it (its escalation, or a SIGKILL asked for)
    exit_seconds: float | None = None  # from the final commit to the last process reaped

    def as_json(self) -> dict[str, Any]:
        return {
            "attempt": self.number,
            "pid": self.pid,
            "state": str(self.state),
            "ending": self.ending.describe(),
            "exit_code": self.exit_code,
            "duration_s": round(self.duration, 3),
            "signals": [signal_name(s.signum) for s in self.signals],
            "forwarded": [s.forwarded for s in self.signals],
            **({"killed": True} if self.killed else {}),
            "ended_at": time.time(),
            **({} if self.exit_seconds is None else {"exit_s": round(self.exit_seconds, 3)}),
        }


def append(journal: Path, attempt: Attempt) -> None:
    """Add ``attempt``'s line to the journal (OSError when it cannot be written)."""
    fd = open_in_place(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with os.fdopen(fd, "a") as fh:
        fh.write(json.dumps(attempt.as_json()) + "\n")


def exit_seconds(attempt_dir: Path, gone: float, duration: float) -> float | None:
    """Seconds from the attempt's final commit (its record's ``committed_at``) to ``gone``,
    when its last process was reaped: the way out (watcher, acknowledgements, tracker,
    interpreter and torch shutdown) that the process cannot time itself. None without a
    final commit, or when the record's time cannot be this attempt's (it is the job's
    input: a bad one must not set the next attempt's budget)."""
    record = read_record(attempt_dir)
    committed = _time(record.get("committed_at"))
    if record.get("state") != RecordState.STOPPED or committed is None:
        return None
    seconds = gone - committed
    return seconds if 0 <= seconds <= duration else None


def measured_exits(journal: Path) -> list[float]:
    """The exit times of the last ``EXIT_HISTORY`` attempts that measured one, oldest first.
    Read from the journal, so that a supervisor started again (a requeued SLURM job, a
    rerun of the same command) knows the run's earlier attempts too."""
    found: list[float] = []
    for entry in reversed(read_journal(journal, JOURNAL_TAIL_BYTES)):
        value = _time(entry.get("exit_s"))
        if value is not None and value >= 0:
            found.append(value)
            if len(found) == EXIT_HISTORY:
                break
    return found[::-1]
