"""The run record as the supervisor may trust it.

``record.json`` is written by the job, so it is input like any other: a bug, a stale file from
another tool or a deliberate forgery can put anything there. The supervisor acts on a few
fields only (whether the run marked itself as preempting and when, whether it stopped early,
on which signal, at which step, where it saved), and every one of them is checked here, once:
known keys, the right types, ``signum`` a real signal number, times finite. Anything else is
dropped, so an odd record can at worst be ignored; it can never crash the supervisor or turn
a failed attempt into exit 0 (classification only lets an exit status of 0 finish a run).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._paths import MAX_STEP
from .._run import read_record
from .._states import STOPPED_EARLY, RecordState, parse

MAX_SIGNUM = 64  # Linux's highest real-time signal
_MAX_TEXT = 4096


@dataclass(frozen=True)
class RunRecord:
    """The checked fields of one attempt's ``record.json``; None where absent or invalid."""

    state: RecordState | None = None
    preempting_at: float | None = None
    stopped_at: float | None = None
    signum: int | None = None
    step: int | None = None
    checkpoint: str | None = None
    checkpoint_dir: str | None = None
    resume_from: str | None = None  # the newest checkpoint the job committed (any name)
    resume_step: int | None = None
    # a bucket (checkpoint_dir a URL): the newest checkpoint that reached it (its URL)
    remote_checkpoint: str | None = None

    @property
    def remote_step(self) -> int | None:
        """The step of ``remote_checkpoint``: the last number in its name (``step-N.ckpt``,
        ``checkpoint-N``, ``keras-N.npz``); None without one (``resume.ckpt``)."""
        name = (self.remote_checkpoint or "").rsplit("/", 1)[-1]
        numbers = re.findall(r"\d+", name)
        step = int(numbers[-1]) if numbers else None
        return step if step is not None and step <= MAX_STEP else None

    @property
    def stopped_early(self) -> bool:
        return self.state in STOPPED_EARLY

    @classmethod
    def from_json(cls, data: object) -> RunRecord:
        """Sanitize whatever ``json.loads`` returned (any type) into a record."""
        if not isinstance(data, dict):
            return cls()
        return cls(
            state=parse(RecordState, data.get("state")),
            preempting_at=_time(data.get("preempting_at")),
            stopped_at=_time(data.get("stopped_at")),
            signum=_int(data.get("signum"), 1, MAX_SIGNUM),
            step=_int(data.get("step"), 0, MAX_STEP),
            checkpoint=_text(data.get("checkpoint")),
            checkpoint_dir=_text(data.get("checkpoint_dir")),
            resume_from=_text(data.get("resume_from")),
            resume_step=_int(data.get("resume_step"), 0, MAX_STEP),
            remote_checkpoint=_text(data.get("remote_checkpoint")),
        )


def load_record(attempt_dir: Path) -> RunRecord:
    """The checked record of an attempt; empty when there is none or it is not a plain file
    (a FIFO would block the reader, a device could be endless)."""
    return RunRecord.from_json(read_record(attempt_dir))


def _time(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float range
        return None
    return number if math.isfinite(number) else None


def _int(value: Any, low: int, high: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if low <= value <= high else None


def _text(value: Any) -> str | None:
    """A string that is safe to log on one line and to use as a path."""
    if not isinstance(value, str) or not value or len(value) > _MAX_TEXT:
        return None
    return value if value.isprintable() else None  # no newlines, controls or surrogates
