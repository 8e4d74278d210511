"""The files of a run, named in one place, and the readers of the ones a job can write.

A run of ``preemptible run`` (or of ``preemptible agent``) lives in ``HOME/runs/RUN_ID/``::

    supervisor.lock     held (flock) by the run's supervisor while it lives
    heartbeat.json      the supervisor's last beat
    attempts.jsonl      the journal: one JSON line per attempt that ended
    params.json         a sweep run's parameters (written by the agent)
    checkpoints/        the default checkpoint directory
    attempt-N/          one per attempt, the attempt's PREEMPTIBLE_RUN_DIR:
        supervisor.json the supervisor that made it (pid, start), written before the job
                        starts: a run nested in the attempt proves it is (``supervisor/_parent.py``)
        record.json     what the attempt tells its supervisor (``_run.py``)
        summary.json    the latest values it reported (``_report.py``)
        history.jsonl   every point it reported, by step (``_report.py``)
        lease.json      a sweep run's lease, renewed by the agent (``notices/_lease.py``)

Everything in a run directory is written by a job or a supervisor that may have been killed
half-way, or by anything else with access: it is read as untrusted input, non-blocking (a
FIFO planted there must not hang a reader), bounded, and only when it is a regular file.
Only the standard library is imported: the handler imports this at import time.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECORD_NAME = "record.json"
SUMMARY_NAME = "summary.json"
HISTORY_NAME = "history.jsonl"
JOURNAL_NAME = "attempts.jsonl"
HEARTBEAT_NAME = "heartbeat.json"
LOCK_NAME = "supervisor.lock"
PARAMS_NAME = "params.json"
LEASE_NAME = "lease.json"
OWNER_NAME = "supervisor.json"  # in an attempt's directory: the supervisor that made it
ENDING_NAME = "ending.json"  # an agent's ending of the attempt, where it is not the supervisor's
CHECKPOINTS_NAME = "checkpoints"
ATTEMPT_PREFIX = "attempt-"
MAX_ATTEMPT_DIGITS = 9
MAX_STEP = 2**63 - 1  # the highest step: a 64-bit integer, in names, records and databases


@dataclass(frozen=True)
class RunPaths:
    """The paths of one run directory (none of them is created here)."""

    run_dir: Path

    @classmethod
    def under(cls, home: Path, run_id: str) -> RunPaths:
        """The run ``run_id`` under a supervisor's ``--home``."""
        return cls(home / "runs" / run_id)

    @property
    def lock(self) -> Path:
        return self.run_dir / LOCK_NAME

    @property
    def heartbeat(self) -> Path:
        return self.run_dir / HEARTBEAT_NAME

    @property
    def journal(self) -> Path:
        return self.run_dir / JOURNAL_NAME

    @property
    def params(self) -> Path:
        return self.run_dir / PARAMS_NAME

    @property
    def checkpoints(self) -> Path:
        """The default checkpoint directory, when the job is given none."""
        return self.run_dir / CHECKPOINTS_NAME

    def attempt(self, number: int) -> Path:
        """Attempt ``number``'s directory (its ``PREEMPTIBLE_RUN_DIR``)."""
        return self.run_dir / f"{ATTEMPT_PREFIX}{number}"

    def record(self, number: int) -> Path:
        return self.attempt(number) / RECORD_NAME

    def summary(self, number: int) -> Path:
        return self.attempt(number) / SUMMARY_NAME

    def history(self, number: int) -> Path:
        return self.attempt(number) / HISTORY_NAME

    def lease(self, number: int) -> Path:
        return self.attempt(number) / LEASE_NAME

    def ending(self, number: int) -> Path:
        return self.attempt(number) / ENDING_NAME

    def attempt_numbers(self, *, directories_only: bool = True) -> list[int]:
        """The numbers of the ``attempt-N`` entries, unsorted; [] when the run directory cannot
        be listed. ``directories_only=False`` counts an entry of any kind: a number to take
        next must not meet a file of that name either."""
        numbers = []
        try:
            with os.scandir(self.run_dir) as entries:
                for entry in entries:
                    digits = entry.name[len(ATTEMPT_PREFIX) :]
                    if (
                        entry.name.startswith(ATTEMPT_PREFIX)
                        and digits.isascii()  # isdecimal() alone takes other scripts' digits
                        and digits.isdecimal()
                        and len(digits) <= MAX_ATTEMPT_DIGITS
                        and (not directories_only or entry.is_dir(follow_symlinks=False))
                    ):
                        numbers.append(int(digits))
        except OSError:
            return []
        return numbers

    def newest_attempt(self) -> int:
        """The highest attempt number with a directory, 0 when there is none."""
        return max(self.attempt_numbers(), default=0)


def file_kind(mode: int) -> str:
    """What an ``st_mode`` is, in words (for a message)."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def read_bounded(path: Path, max_bytes: int) -> bytes:
    """Up to ``max_bytes + 1`` bytes of a regular file (one more than allowed, so a caller can
    tell a file that is too large). Opened non-blocking and checked before reading: a FIFO
    would block, a device be endless. Raises OSError: FileNotFoundError and the like as
    ``open`` does, and one with EINVAL saying what the path is for anything but a regular
    file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"is {file_kind(mode)}, not a regular file", str(path))
        with open(fd, "rb", closefd=False) as fh:
            return fh.read(max_bytes + 1)
    finally:
        os.close(fd)


def read_regular(path: Path, max_bytes: int) -> bytes | None:
    """Up to ``max_bytes`` of a regular file, or None when it is missing, unreadable or not a
    regular file (``read_bounded``, for readers to whom all of those mean "nothing there")."""
    try:
        return read_bounded(path, max_bytes)[:max_bytes]
    except (OSError, ValueError):
        return None


def _read(path: Path, max_bytes: int, *, tail: bool) -> tuple[bytes, int] | None:
    """(data, the offset it starts at): the first ``max_bytes``, or the last with ``tail``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        start = max(info.st_size - max_bytes, 0) if tail else 0
        with open(fd, "rb", closefd=False) as fh:
            fh.seek(start)
            data = fh.read(max_bytes + (0 if tail else 1))[:max_bytes]
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return data, start


def read_json_object(path: Path, max_bytes: int) -> dict[str, Any]:
    """A JSON object written by an attempt, or {} when it is missing, unreadable, not an
    object, or not a regular file."""
    data = read_regular(path, max_bytes)
    if data is None:
        return {}
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # ValueError: bad JSON or bad UTF-8
        return {}
    return value if isinstance(value, dict) else {}


def tail_lines(path: Path, limit: int) -> list[str]:
    """The lines of the last ``limit`` bytes of a regular file, [] when it cannot be read."""
    read = _read(path, limit, tail=True)
    if read is None:
        return []
    data, start = read
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[1:] if start > 0 else lines  # the first one was cut


def read_journal(path: Path, max_bytes: int) -> list[dict[str, Any]]:
    """The entries of an attempts journal, oldest first, read from its last ``max_bytes``:
    one per line that is not blank, {} for a line that is not a JSON object. A reader checks
    the fields it uses (any type can be there)."""
    entries = []
    for line in tail_lines(path, max_bytes):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            entry = None
        entries.append(entry if isinstance(entry, dict) else {})
    return entries
