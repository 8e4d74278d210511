"""``preemptible.report(**metrics)``: the latest metrics of this run, for its supervisor.

A sweep agent needs each run's metric (``bayes`` learns from it, ``status`` shows it). The
training process reports as often as it likes, every step if it wants: a call only merges the
values into a dict in memory. They reach ``summary.json`` in the attempt's run directory at
most once a second, and once more when the process exits, so a loop of 1 ms steps pays
microseconds, not a file write per step. Without a supervisor (no ``PREEMPTIBLE_RUN_DIR``)
nothing is written.

``summary.json`` is a file of its own rather than part of ``record.json``: the record is
written durably (fsync) at the moments a stop needs it, and a metric written once a second must
neither slow that down nor race with it.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

from ._errors import ConfigError
from ._files import write_text_atomic
from ._paths import SUMMARY_NAME, read_json_object
from ._run import current_run

logger = logging.getLogger("preemptible")

WRITE_EVERY = 1.0
"""Seconds between two writes of summary.json (the last values are written at exit too)."""
MAX_KEY = 200
MAX_TEXT = 1000
MAX_KEYS = 1000
MAX_SUMMARY_BYTES = 1 << 20

_lock = threading.Lock()
_latest: dict[str, Any] = {}
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


def report(**metrics: Any) -> None:
    """Record the latest value of each metric for this run's supervisor (``preemptible agent``
    stores them in the sweep's queue; ``bayes`` and ``preemptible status`` read them). Cheap
    enough for every step: values reach the run directory at most once a second and at exit.
    """
    global _dirty
    clean: dict[str, Any] = {}
    for key, value in metrics.items():
        if not key or len(key) > MAX_KEY:
            raise ConfigError(f"report(): a metric name of 1 to {MAX_KEY} characters, not {key!r}")
        clean[key] = _value(key, value)
    with _lock:
        new = set(clean) - set(_latest)
        if len(_latest) + len(new) > MAX_KEYS:
            raise ConfigError(f"report(): at most {MAX_KEYS} different metrics in one run")
        _latest.update(clean)
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
        _dirty = False
        _last_write = time.monotonic()
        try:
            path = run_dir / SUMMARY_NAME
            write_text_atomic(path, text)
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


def read_summary(run_dir: Path) -> dict[str, Any]:
    """The metrics an attempt reported, or {} (missing, unreadable, not a regular file)."""
    return read_json_object(run_dir / SUMMARY_NAME, MAX_SUMMARY_BYTES)


def _hook() -> None:
    global _hooked
    if not _hooked:
        _hooked = True
        atexit.register(flush)


def _reset_for_tests() -> None:
    global _dirty, _last_write
    with _lock:
        _latest.clear()
        _dirty = False
        _last_write = -math.inf
