"""What a stop request is, how it is configured, and when to act on it.

A ``Notice`` is one announcement that the run will be stopped: a signal, a platform notice
found by a watcher, a stop file. Some carry a deadline (a cloud's termination time, notice
time + ``grace_period``); a notice without one means "as soon as possible".

The grace policy decides, at each step boundary, whether there is still time for more
training: continue while ``now + safety * (save_time + 2 * step_time) < deadline``. The save
time is *measured* (the insurance checkpoint written right after the notice is the first
measurement) because for a large model it dominates the window; a policy that only counts
step times saves too late.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._errors import ConfigError

logger = logging.getLogger("preemptible")

WatcherResult = Any  # bool, None, or a Notice
SaveFn = Callable[[Path], None]
ExitFn = Callable[[int], Any]


@dataclass(frozen=True, kw_only=True)
class Notice:
    """One announcement that the run will be stopped.

    ``source`` names where it came from ("SIGTERM", "watcher", "gce", ...); ``received_at``
    and ``deadline`` are wall-clock seconds (``time.time()``); ``signum`` is set for signals.
    ``stop=False`` marks an early warning (EC2 rebalance): save once, keep training.
    ``acknowledge``, when set, is called after the final checkpoint (Azure's StartRequests),
    so the platform need not wait out the whole notice.
    """

    source: str
    received_at: float = field(default_factory=time.time)
    deadline: float | None = None
    signum: int | None = None
    stop: bool = True
    detail: str = ""
    acknowledge: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    @property
    def exit_code(self) -> int:
        """128 + signum for a signal, 143 (as for SIGTERM) for anything else."""
        return 128 + (self.signum if self.signum is not None else 15)


@dataclass(kw_only=True)
class TerminationConfig:
    """How a run learns it will be stopped and what happens then (TensorFlow's meaning).

    termination_watcher_fn: called from a background daemon thread every ``poll_interval``
        seconds; return True (or a ``Notice``) when termination is imminent. It must not
        block for long; an exception is logged once and polling goes on.
    exit_fn: called with the exit code after the final checkpoint is committed. Default:
        ``sys.exit(code)``, where code is 128 + signum for a signal and 143 for a notice.
    grace_period: seconds between a notice and the hard stop. With it, the handler saves an
        insurance checkpoint at once, keeps training, and saves again at the last safe moment.
    save_fn: replaces the default save; called as ``save_fn(path)`` and must write the
        checkpoint to ``path`` (a file or a directory), which preemptible then commits
        atomically. Resume with ``handler.resume()`` (the step) and ``handler.resume_path``.
    poll_interval: seconds between two watcher calls.
    safety_factor: margin applied to (save time + 2 step times) by the grace policy.
    """

    termination_watcher_fn: Callable[[], WatcherResult] | None = None
    exit_fn: ExitFn | None = None
    grace_period: float | None = None
    save_fn: SaveFn | None = None
    poll_interval: float = 1.0
    safety_factor: float = 1.25

    def __post_init__(self) -> None:
        if self.grace_period is not None and not (
            isinstance(self.grace_period, int | float)
            and math.isfinite(self.grace_period)
            and self.grace_period >= 0
        ):
            raise ConfigError(
                f"grace_period={self.grace_period!r} is not valid; use None or seconds >= 0"
            )
        if not (self.poll_interval > 0 and math.isfinite(self.poll_interval)):
            raise ConfigError(f"poll_interval={self.poll_interval!r} is not valid; use seconds > 0")
        if not (self.safety_factor >= 1 and math.isfinite(self.safety_factor)):
            raise ConfigError(
                f"safety_factor={self.safety_factor!r} is not valid; use a number >= 1"
            )
        for name in ("termination_watcher_fn", "exit_fn", "save_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigError(f"{name} must be callable or None, not {type(value).__name__}")


class Durations:
    """Recent durations of one kind (steps, saves); conservative summaries for the policy."""

    def __init__(self, window: int = 16) -> None:
        self._values: deque[float] = deque(maxlen=window)

    def add(self, seconds: float) -> None:
        self._values.append(seconds)

    def __len__(self) -> int:
        return len(self._values)

    def max(self) -> float:
        return max(self._values, default=0.0)

    def median(self) -> float:
        if not self._values:
            return 0.0
        ordered = sorted(self._values)
        return ordered[len(ordered) // 2]


class StopRequests:
    """The notices received so far. Appends come from a signal handler or a watcher thread;
    ``list.append`` is atomic under the GIL, so neither needs a lock (a lock taken inside a
    signal handler can deadlock the main thread that already holds it)."""

    def __init__(self, grace_period: float | None = None) -> None:
        self.grace_period = grace_period
        self._notices: list[Notice] = []

    def add(self, notice: Notice) -> None:
        self._notices.append(notice)

    @property
    def notices(self) -> list[Notice]:
        return list(self._notices)

    @property
    def stopping(self) -> list[Notice]:
        return [n for n in self._notices if n.stop]

    def __bool__(self) -> bool:
        return bool(self._notices)

    def first_stop(self) -> Notice | None:
        stops = self.stopping
        return stops[0] if stops else None

    def deadline(self) -> float | None:
        """The earliest deadline of the stopping notices; ``received_at`` for one without."""
        best: float | None = None
        for n in self.stopping:
            if n.deadline is not None:
                d = n.deadline
            elif self.grace_period is not None:
                d = n.received_at + self.grace_period
            else:
                d = n.received_at
            best = d if best is None else min(best, d)
        return best

    def must_stop_now(
        self, *, now: float, save_time: float, step_time: float, safety: float
    ) -> bool:
        """True when one more step would risk missing the deadline (or there is none)."""
        deadline = self.deadline()
        if deadline is None:
            return False
        if not any(n.deadline is not None for n in self.stopping) and self.grace_period is None:
            return True  # a plain stop request: stop at this boundary
        return now + safety * (save_time + 2 * step_time) >= deadline


class Watcher:
    """Polls ``fn`` from a daemon thread until it reports a notice or ``stop()`` is called."""

    def __init__(
        self,
        fn: Callable[[], WatcherResult],
        on_notice: Callable[[Notice], None],
        *,
        interval: float,
        name: str = "watcher",
    ) -> None:
        self._fn = fn
        self._on_notice = on_notice
        self._interval = interval
        self._name = name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"preemptible-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._interval + 1)

    def _loop(self) -> None:
        failed_before = False
        while not self._stop.is_set():
            try:
                result = self._fn()
            except Exception as exc:  # a watcher must never break training
                if not failed_before:
                    logger.warning(
                        "preemptible: termination watcher %s raised %s: %s (logged once; "
                        "polling goes on)",
                        self._name,
                        type(exc).__name__,
                        exc,
                    )
                    failed_before = True
                else:
                    logger.debug("preemptible: watcher %s raised again: %r", self._name, exc)
                result = None
            notice = _as_notice(result, self._name)
            if notice is not None:
                logger.warning(
                    "preemptible: %s reported a termination notice%s",
                    self._name,
                    f" ({notice.detail})" if notice.detail else "",
                )
                self._on_notice(notice)
                if notice.stop:
                    return
            self._stop.wait(self._interval)


def _as_notice(result: WatcherResult, name: str) -> Notice | None:
    if isinstance(result, Notice):
        return result
    if result:
        return Notice(source=name)
    return None
