"""A run's history of interruptions, read from the directory of ``preemptible run``: its
attempts journal (``attempts.jsonl``) and one ``attempt-N/`` per attempt with its run record.

Everything here is read as untrusted input: odd lines are skipped, a journal that is not a
regular file is ignored, only the tail of a huge one is read. Only the standard library is
imported: the handler imports this at import time.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

HOUR = 3600.0
JOURNAL_MAX_BYTES = 4 << 20  # only the tail of a larger journal is read
MAX_DURATION = 366 * 24 * HOUR  # a journal line claiming a longer attempt is skipped
STATES = ("FINISHED", "FAILED", "PREEMPTED", "KILLED", "CRASHED")


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
    root = Path(run_dir)
    uptime, interruptions, losses, attempts, skipped = 0.0, 0, 0, 0, 0
    journaled: set[int] = set()
    for line in tail_lines(root / "attempts.jsonl", JOURNAL_MAX_BYTES):
        parsed = _attempt_line(line)
        if parsed is None:
            if line.strip():
                skipped += 1
            continue
        number, state, duration = parsed
        journaled.add(number)
        attempts += 1
        uptime += duration
        if state == "CRASHED" or (
            state == "PREEMPTED" and not _record(root / f"attempt-{number}").stopped
        ):
            interruptions += 1
            losses += 1
        elif state == "PREEMPTED":
            interruptions += 1
    numbers = _attempt_dirs(root)
    if numbers:
        for number in numbers:
            if number < max(numbers) and number not in journaled:  # vanished
                interruptions += 1
                losses += not _record(root / f"attempt-{number}").stopped
    save_cost = None
    for number in sorted(numbers, reverse=True)[:100]:
        save_cost = _record(root / f"attempt-{number}").save_cost
        if save_cost is not None:
            break
    return History(uptime, interruptions, losses, attempts, skipped, save_cost)


def tail_lines(path: Path, limit: int) -> list[str]:
    """The lines of the last ``limit`` bytes of a regular file, [] when it cannot be read.
    Opened non-blocking and checked before reading: a FIFO would block, a device be endless."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return []
        start = max(info.st_size - limit, 0)
        with open(fd, "rb", closefd=False) as fh:
            fh.seek(start)
            data = fh.read(limit)
    except OSError:
        return []
    finally:
        os.close(fd)
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[1:] if start > 0 else lines  # the first one was cut


def _attempt_line(line: str) -> tuple[int, str, float] | None:
    """(attempt number, state, duration) of one journal line, or None when it is odd."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(entry, dict):
        return None
    number, state, duration = entry.get("attempt"), entry.get("state"), entry.get("duration_s")
    if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number < 10**9:
        return None
    if state not in STATES:
        return None
    if isinstance(duration, bool) or not isinstance(duration, int | float):
        return None
    if not 0 <= duration <= MAX_DURATION:  # False for nan; no float() of a huge int
        return None
    return number, str(state), float(duration)


@dataclass(frozen=True)
class _Record:
    stopped: bool = False  # the attempt stopped after committing a final checkpoint
    save_cost: float | None = None  # its measured save cost, seconds


def _record(attempt_dir: Path) -> _Record:
    """The two fields of an attempt's run record that matter here, checked (it is written
    by the job: any type can be there); empty when missing or not a regular file."""
    from .._run import RECORD_NAME, read_record

    try:
        if not stat.S_ISREG((attempt_dir / RECORD_NAME).stat().st_mode):
            return _Record()
    except (OSError, ValueError):
        return _Record()
    record = read_record(attempt_dir)
    checkpoint, cost = record.get("checkpoint"), record.get("save_s")
    stopped = record.get("state") == "stopped" and isinstance(checkpoint, str) and checkpoint != ""
    if isinstance(cost, bool) or not isinstance(cost, int | float):
        return _Record(stopped)
    valid = 0 <= cost < MAX_DURATION  # False for nan; no float() of a huge int
    return _Record(stopped, float(cost) if valid else None)


def _attempt_dirs(root: Path) -> list[int]:
    numbers = []
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                name = entry.name
                digits = name[8:]
                if (
                    name.startswith("attempt-")
                    and digits.isdecimal()
                    and len(digits) < 10
                    and entry.is_dir(follow_symlinks=False)
                ):
                    numbers.append(int(digits))
    except OSError:
        return []
    return numbers
