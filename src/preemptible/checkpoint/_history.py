"""A run's history of interruptions, read from the directory of ``preemptible run``: its
attempts journal (``attempts.jsonl``) and one ``attempt-N/`` per attempt with its run record.

Everything here is read as untrusted input: odd lines are skipped, a journal that is not a
regular file is ignored, only the tail of a huge one is read. Only the standard library is
imported: the handler imports this at import time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._paths import RunPaths, read_journal
from .._states import RecordState, RunState, parse

HOUR = 3600.0
JOURNAL_MAX_BYTES = 4 << 20  # only the tail of a larger journal is read
MAX_DURATION = 366 * 24 * HOUR  # a journal line claiming a longer attempt is skipped


@dataclass(frozen=True)
class History:
    """What the earlier attempts of a run say about its interruptions."""

    uptime: float = 0.0  # seconds the attempts ran, together
    interruptions: int = 0  # attempts that ended PREEMPTED or CRASHED, or vanished
    losses: int = 0  # of those, the ones without a committed final checkpoint
    attempts: int = 0  # journal lines used
    skipped: int = 0  # journal lines that were not usable
    save_cost: float | None = None  # the newest attempt's measured save cost (record "save_s")


def read_history(run_dir: str | os.PathLike[str]) -> History:
    """The history in a run directory of ``preemptible run`` (``attempts.jsonl`` and one
    ``attempt-N/`` per attempt), read as untrusted input: odd lines are skipped, a journal
    that is not a regular file is ignored, and only its last 4 MiB are read.

    An ``attempt-N/`` without a journal line, older than the newest attempt, is an attempt
    whose supervisor vanished (the machine was lost): an interruption, unannounced unless its
    run record says it stopped with a checkpoint, whose uptime is unknown (counted as 0, which
    errs towards saving more often)."""
    run = RunPaths(Path(run_dir))
    uptime, interruptions, losses, attempts, skipped = 0.0, 0, 0, 0, 0
    journaled: set[int] = set()
    for entry in read_journal(run.journal, JOURNAL_MAX_BYTES):
        parsed = _attempt_fields(entry)
        if parsed is None:
            skipped += 1
            continue
        number, state, duration = parsed
        journaled.add(number)
        attempts += 1
        uptime += duration
        if state is RunState.CRASHED or (
            state is RunState.PREEMPTED and not _record(run.attempt(number)).stopped
        ):
            interruptions += 1
            losses += 1
        elif state is RunState.PREEMPTED:
            interruptions += 1
    numbers = run.attempt_numbers()
    if numbers:
        for number in numbers:
            if number < max(numbers) and number not in journaled:  # vanished
                interruptions += 1
                losses += not _record(run.attempt(number)).stopped
    save_cost = None
    for number in sorted(numbers, reverse=True)[:100]:
        save_cost = _record(run.attempt(number)).save_cost
        if save_cost is not None:
            break
    return History(uptime, interruptions, losses, attempts, skipped, save_cost)


def _attempt_fields(entry: dict[str, Any]) -> tuple[int, RunState, float] | None:
    """(attempt number, state, duration) of one journal entry, or None when it is odd."""
    number, duration = entry.get("attempt"), entry.get("duration_s")
    state = parse(RunState, entry.get("state"))
    if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number < 10**9:
        return None
    if state is None:
        return None
    if isinstance(duration, bool) or not isinstance(duration, int | float):
        return None
    if not 0 <= duration <= MAX_DURATION:  # False for nan; no float() of a huge int
        return None
    return number, state, float(duration)


@dataclass(frozen=True)
class _Record:
    stopped: bool = False  # the attempt stopped after committing a final checkpoint
    save_cost: float | None = None  # its measured save cost, seconds


def _record(attempt_dir: Path) -> _Record:
    """The two fields of an attempt's run record that matter here, checked (it is written
    by the job: any type can be there); empty when missing or not a regular file."""
    from .._run import read_record

    record = read_record(attempt_dir)
    checkpoint, cost = record.get("checkpoint"), record.get("save_s")
    committed = isinstance(checkpoint, str) and checkpoint != ""
    stopped = record.get("state") == RecordState.STOPPED and committed
    if isinstance(cost, bool) or not isinstance(cost, int | float):
        return _Record(stopped)
    valid = 0 <= cost < MAX_DURATION  # False for nan; no float() of a huge int
    return _Record(stopped, float(cost) if valid else None)
