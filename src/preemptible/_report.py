"""``preemptible.report(step=None, **metrics)``: this run's metrics, for its supervisor.

A sweep agent needs each run's metric (``bayes`` learns from it, ``status`` shows it,
Hyperband compares histories, the web page draws them). The training process reports as
often as it likes, every step if it wants: a call only merges the values into a dict in
memory and notes the numbers as points of the run's history. They reach the attempt's run
directory at most once a second, and once more when the process exits, so a loop of 1 ms
steps pays microseconds, not a file write per step: the latest values in ``summary.json``,
the new points appended to ``history.jsonl`` (one line per report, ``{"step": S, "values":
{...}}``). Without a supervisor (no ``PREEMPTIBLE_RUN_DIR``) nothing is written.

The history is keyed by training step, so that a run stopped and resumed from its checkpoint
has the history an uninterrupted run would have (the agent drops the points after the step
the new attempt resumes from). The step is ``step=`` when given; else the step of the
front-end kit's session of this process (the torch loop handler, the Lightning, Hugging Face
and Keras callbacks), else one more than the previous report's, counting on from the step of
the checkpoint the attempt resumed from. Only finite numbers are points (a NaN, a text, a bool
is kept in the summary only); a later report at the same step replaces the earlier value.

``summary.json`` is a file of its own rather than part of ``record.json``: the record is
written durably (fsync) at the moments a stop needs it, and a metric written once a second must
neither slow that down nor race with it.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import stat
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Protocol

from ._errors import ConfigError
from ._files import write_text_atomic
from ._paths import HISTORY_NAME, MAX_STEP, SUMMARY_NAME, read_json_object
from ._run import current_run

logger = logging.getLogger("preemptible")

WRITE_EVERY = 1.0
"""Seconds between two writes of summary.json (the last values are written at exit too)."""
MAX_KEY = 200
MAX_TEXT = 1000
MAX_KEYS = 1000
MAX_SUMMARY_BYTES = 1 << 20
MAX_HISTORY_BYTES = 64 << 20
"""An attempt's ``history.jsonl`` grows to this at most; later points are left out, said once."""
MAX_READ = 4 << 20  # what a reader takes of a history file at a time
_RESUMED_STEP = re.compile(r"(\d+)(?:\.\w+)?$")  # step-0000000120.ckpt, checkpoint-120


class _Stepped(Protocol):
    step: int


_lock = threading.Lock()
_latest: dict[str, Any] = {}
_points: list[tuple[int, dict[str, float]]] = []  # reported, not yet written
_last_step: int | None = None  # the step of this process's last point
_session: weakref.ReferenceType[_Stepped] | None = None
_history_bytes = 0
_dirty = False
_last_write = -math.inf
_hooked = False
_warned = False


def _value(key: str, value: object) -> bool | int | float | str | None:
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            float(value)  # what a sweep ranks by; JSON readers make floats of big ints too
        except OverflowError:
            raise ConfigError(
                f"report({key}=...): an integer of {value.bit_length()} bits, more than a float "
                "holds; report a float or a text"
            ) from None
    if value is None or isinstance(value, bool | int | str):
        if isinstance(value, str) and len(value) > MAX_TEXT:
            raise ConfigError(
                f"report({key}=...): a text of {len(value)} characters; at most {MAX_TEXT}"
            )
        return value
    if isinstance(value, float):
        # NaN and infinities are kept as text: JSON has no such numbers, and a loss that went
        # NaN is worth seeing, but it is not a metric a search can rank
        return value if math.isfinite(value) else str(value)
    item = getattr(value, "item", None)  # a one-element tensor or numpy scalar
    if callable(item):
        try:
            inner = item()
        except (ValueError, RuntimeError, TypeError):  # more than one element
            inner = value
        if inner is not value and not hasattr(inner, "item"):
            return _value(key, inner)
    raise ConfigError(
        f"report({key}=...): {type(value).__name__} is not a metric; report a number "
        "(int, float, a one-element tensor), a bool, a text or None"
    )


def report(*, step: int | None = None, **metrics: Any) -> None:
    """Record the value of each metric at ``step`` for this run's supervisor (``preemptible
    agent`` stores them in the sweep's queue; ``bayes``, Hyperband, ``preemptible status`` and
    its web page read them). ``step``: the training step the values belong to (module
    docstring for the default). Cheap enough for every step: values reach the run directory
    at most once a second and at exit.
    """
    global _dirty, _last_step
    if step is not None and (
        isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP
    ):
        raise ConfigError(f"report(step={step!r}): a step is an integer from 0 to {MAX_STEP}")
    clean: dict[str, Any] = {}
    for key, value in metrics.items():
        if not key or len(key) > MAX_KEY:
            raise ConfigError(f"report(): a metric name of 1 to {MAX_KEY} characters, not {key!r}")
        clean[key] = _value(key, value)
    numbers = {
        k: float(v)
        for k, v in clean.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    if step is not None:
        clean["step"] = step  # the summary keeps the last step, as before the history had it
    with _lock:
        new = set(clean) - set(_latest)
        if len(_latest) + len(new) > MAX_KEYS:
            raise ConfigError(f"report(): at most {MAX_KEYS} different metrics in one run")
        _latest.update(clean)
        if numbers:
            at = _default_step() if step is None else step
            if _points and _points[-1][0] == at:
                _points[-1][1].update(numbers)
            else:
                _points.append((at, numbers))
            _last_step = at
        _dirty = True
    _hook()
    if time.monotonic() - _last_write >= WRITE_EVERY:
        flush()


def flush() -> Path | None:
    """Write the reported values now (also called at exit); None when there is nothing to
    write or no supervisor. Best effort: a failed write is logged once."""
    global _dirty, _last_write, _warned
    run_dir = current_run().run_dir
    with _lock:
        if run_dir is None or not _dirty:
            return None
        text = json.dumps(_latest, sort_keys=True)
        points = _points[:]
        _points.clear()
        _dirty = False
        _last_write = time.monotonic()
        try:
            path = run_dir / SUMMARY_NAME
            write_text_atomic(path, text)
            _append_history(run_dir / HISTORY_NAME, points)
            return path
        except OSError as exc:
            if not _warned:
                _warned = True
                logger.warning(
                    "preemptible: cannot write the metrics in %s (%s); training goes on",
                    run_dir,
                    exc,
                )
            return None


def follow_steps(session: _Stepped) -> None:
    """Take the step of a report without ``step=`` from ``session.step`` (the front-end
    kit's session calls this; held weakly)."""
    global _session
    _session = weakref.ref(session)


def _default_step() -> int:
    session = _session() if _session is not None else None
    if session is not None:
        return int(session.step)
    if _last_step is not None:
        return min(_last_step + 1, MAX_STEP)
    return min(_resumed_step() + 1, MAX_STEP)


def _resumed_step() -> int:
    """The step of the checkpoint this attempt resumed from, by its name; 0 without one."""
    resume = current_run().resume_from
    match = _RESUMED_STEP.search(resume.name) if resume is not None else None
    return min(int(match.group(1)), MAX_STEP) if match else 0


def _append_history(path: Path, points: list[tuple[int, dict[str, float]]]) -> None:
    """Append the points to the attempt's history file, up to ``MAX_HISTORY_BYTES``."""
    global _history_bytes, _warned
    if not points or _history_bytes > MAX_HISTORY_BYTES:
        return
    text = "".join(
        json.dumps({"step": step, "values": values}, sort_keys=True) + "\n"
        for step, values in points
    ).encode()
    if _history_bytes + len(text) > MAX_HISTORY_BYTES:
        _history_bytes = MAX_HISTORY_BYTES + 1
        logger.warning(
            "preemptible: the metric history in %s reached %d MiB; later points are left out "
            "(the latest values are still reported)",
            path.parent,
            MAX_HISTORY_BYTES >> 20,
        )
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.write(fd, text)  # one write: a reader sees whole lines, or a part it waits on
    finally:
        os.close(fd)
    _history_bytes += len(text)


def read_history(path: Path, offset: int = 0) -> tuple[list[tuple[int, str, float]], int]:
    """The points of an attempt's ``history.jsonl`` from byte ``offset`` on, read as untrusted
    input: (points as (step, name, value), the offset to read on from). At most ``MAX_READ``
    bytes a call; a last line without its newline is left for the next call; lines that are
    not a point, steps outside 0..MAX_STEP and values that are not finite numbers are skipped.
    A file that is missing or not a regular file reads as nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return [], offset
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return [], offset
        data = os.pread(fd, MAX_READ, offset)
    except OSError:
        return [], offset
    finally:
        os.close(fd)
    end = data.rfind(b"\n") + 1
    if end == 0:
        # a line longer than a whole read is no point: skip it
        return [], offset + len(data) if len(data) == MAX_READ else offset
    points: list[tuple[int, str, float]] = []
    for line in data[:end].splitlines():
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("values"), dict):
            continue
        step = entry.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
            continue
        for name, value in entry["values"].items():
            if not isinstance(name, str) or not 0 < len(name) <= MAX_KEY:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            try:
                number = float(value)
            except OverflowError:  # an integer beyond a float
                continue
            if math.isfinite(number):
                points.append((step, name, number))
    return points, offset + end


def read_summary(run_dir: Path) -> dict[str, Any]:
    """The metrics an attempt reported, or {} (missing, unreadable, not a regular file)."""
    return read_json_object(run_dir / SUMMARY_NAME, MAX_SUMMARY_BYTES)


def _hook() -> None:
    global _hooked
    if not _hooked:
        _hooked = True
        atexit.register(flush)


def _reset_for_tests() -> None:
    global _dirty, _last_write, _last_step, _session, _history_bytes
    with _lock:
        _latest.clear()
        _points.clear()
        _dirty = False
        _last_write = -math.inf
        _last_step = _session = None
        _history_bytes = 0
