"""What a stop request is, how it is configured, and when to act on it.

A ``Notice`` is one announcement that the run will be stopped: a signal, a platform notice
found by a watcher, a stop file. Some carry a deadline (a cloud's termination time, notice
time + ``grace_period``); a notice without one means "as soon as possible".

The grace policy decides, at each step boundary, whether there is still time for one more
step. The process must be *gone* by the deadline, not only checkpointed, so it keeps training
while

    now + step + save + exit + DECISION_MARGIN < deadline - detection latency

where step, save and exit are pessimistic bounds (``Durations.bound``) of the measured
durations: the longest recent one or mean + safety * SPREAD_Z * spread, whichever is larger.
One step suffices, not two: the decision is taken again at every boundary, so a step that
fits within its bound leaves exactly the save and the exit. The save time is *measured* (the
insurance checkpoint written right after the notice is the first measurement) because for a
large model it dominates the window; a policy that only counts step times saves too late. A
flat factor on the save, as before, gives away most of a long save: the spread of saves is
usually far smaller than 25 % of them. With few measurements the spread is unknown, so it
starts from a prior share of the mean (``PRIOR_SPREAD``; at the default safety a duration
measured once is budgeted at 1.225x, about the old margin) and moves to the measured spread as
measurements come in. ``benchmarks/bench_grace_window.py`` checks the constants: at its
default jitter, no deadline missed in 200 notices per row of its grid, and at least 90 % of the
usable window kept wherever a policy that can never miss can keep that much.
"""

from __future__ import annotations

import atexit
import gc
import logging
import math
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from .._env import env_float
from .._errors import ConfigError

logger = logging.getLogger("preemptible")

WatcherResult = Any  # bool, None, or a Notice
SaveFn = Callable[[Path], None]
ExitFn = Callable[[int], Any]

EXIT_TIME = 0.75
"""Seconds from the final commit to the process being gone (watcher stop, acknowledgements,
interpreter and torch shutdown), assumed until ``preemptible run`` passes a measurement; the
policy budgets about twice this (``EXIT_PRIOR_SPREAD``), 1.5 s. Measured with
``exit_process`` on 2 cores shared with other test runs: 0.30-0.45 s for a plain loop and
0.35-0.6 s for a Lightning fit at a load of 3.5, up to 1.1 s for either at 5-7 (0.2 and
0.3 s of CPU); a plain ``sys.exit`` took 1-6 s."""
EXIT_SECONDS_ENV = "PREEMPTIBLE_EXIT_SECONDS"
"""Set by ``preemptible run`` for each attempt after one whose exit it measured (from the
record's ``committed_at`` to the moment the last process of the attempt was reaped)."""
SPREAD_Z = 1.8
"""How many spreads above the mean a bound reaches, before ``safety_factor`` scales it: at the
default safety, 2.25 spreads, which covers saves that vary by +-10 % entirely once a few are
measured (their spread is 5.8 % of the mean)."""
PRIOR_SPREAD = 0.1
"""The spread assumed for steps and saves, as a share of their mean, before there are enough
measurements to know it; it weighs as ``PRIOR_WEIGHT`` measurements of the spread. A save
measured once is budgeted at 1 + 1.25 * 1.8 * 0.1 = 1.225x: two saves that vary by +-10 %
differ by 1.1 / 0.9 = 1.222x at most."""
PRIOR_WEIGHT = 2
"""With less, a few saves that happen to be alike (all fast) make a bound the next one
overruns: 0.2 % of the time with 2-5 saves that vary by +-10 %; with 2, 0.03 %."""
EXIT_PRIOR_SPREAD = 0.45
"""The same for the exit: shutdown varies more and is known from one earlier attempt at most,
so an exit measured once is budgeted at about twice that (a measured 0.4 s ranged 0.3-0.6 s)."""
DECISION_MARGIN = 0.05
"""Seconds for what no measurement covers: the boundary itself, reading the clock."""


@dataclass(frozen=True, kw_only=True)
class Notice:
    """One announcement that the run will be stopped.

    ``source`` names where it came from ("SIGTERM", "watcher", "gce", ...); ``received_at``
    and ``deadline`` are wall-clock seconds (``time.time()``); ``signum`` is set for signals.
    ``stop=False`` marks an early warning (EC2 rebalance): save once, keep training.
    ``acknowledge``, when set, is called after the final checkpoint (Azure's StartRequests),
    so the platform need not wait out the whole notice.
    ``detection_latency``: seconds the event may have preceded ``received_at`` when the
    deadline is only counted from the moment the notice was seen (GCE gives no time: the
    time since the last poll that did not see it). The policy moves the deadline that much
    earlier, so the process is gone before the platform's real deadline.
    """

    source: str
    received_at: float = field(default_factory=time.time)
    deadline: float | None = None
    signum: int | None = None
    stop: bool = True
    detail: str = ""
    acknowledge: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    detection_latency: float = 0.0

    def __post_init__(self) -> None:
        latency = self.detection_latency
        if not (isinstance(latency, int | float) and math.isfinite(latency) and latency >= 0):
            raise ConfigError(
                f"Notice detection_latency={latency!r} is not valid; use seconds >= 0"
            )

    @property
    def exit_code(self) -> int:
        """128 + signum for a signal, 143 (as for SIGTERM) for anything else."""
        return signal_exit_code(self.signum)


def signal_exit_code(signum: int | None) -> int:
    """The exit code of a run stopped by ``signum``: 128 + signum (the shell's convention, what
    schedulers read as "stopped by that signal"), 143 as for SIGTERM when a notice, a stop file
    or the program itself stopped it (None). Every part of preemptible that exits because of a
    stop takes its code from here."""
    return 128 + (int(signal.SIGTERM) if signum is None else signum)


@dataclass(kw_only=True)
class TerminationConfig:
    """How a run learns it will be stopped and what happens then (TensorFlow's meaning).

    termination_watcher_fn: called from a background daemon thread every ``poll_interval``
        seconds; return True (or a ``Notice``) when termination is imminent. It must not
        block for long; an exception is logged once and polling goes on.
    exit_fn: called with the exit code after the final checkpoint is committed. Default
        (None): ``exit_process``, i.e. ``sys.exit(code)`` with a short interpreter shutdown,
        where code is 128 + signum for a signal and 143 for a notice.
    grace_period: seconds between a notice and the hard stop. With it, the handler saves an
        insurance checkpoint at once, keeps training, and saves again at the last safe moment.
    save_fn: replaces the default save; called as ``save_fn(path)`` and must write the
        checkpoint to ``path`` (a file or a directory), which preemptible then commits
        atomically. Resume with ``handler.resume()`` (the step) and ``handler.resume_path``.
    poll_interval: seconds between two watcher calls.
    safety_factor: how far above the measured durations the grace policy budgets: it scales
        the spread term of every bound (mean + safety * 1.8 spreads), so 1.25 budgets a save
        measured once at 1.225x and a well-measured one at its mean + 2.25 standard
        deviations (or its longest recent duration, when that is more).
    exit_time: seconds from the final checkpoint to the process being gone, when known (a
        slow ``torch.distributed`` teardown, a tracker upload); None: what ``preemptible run``
        measured for the run's earlier attempts (``PREEMPTIBLE_EXIT_SECONDS``), else
        ``EXIT_TIME``.
    """

    termination_watcher_fn: Callable[[], WatcherResult] | None = None
    exit_fn: ExitFn | None = None
    grace_period: float | None = None
    save_fn: SaveFn | None = None
    poll_interval: float = 1.0
    safety_factor: float = 1.25
    exit_time: float | None = None

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
        if self.exit_time is None:
            # what ``preemptible run`` measured for this run's earlier attempts, if any
            self.exit_time = env_float(EXIT_SECONDS_ENV)
        if self.exit_time is not None and not (
            isinstance(self.exit_time, int | float)
            and math.isfinite(self.exit_time)
            and self.exit_time >= 0
        ):
            raise ConfigError(
                f"exit_time={self.exit_time!r} is not valid; use None or seconds >= 0"
            )
        for name in ("termination_watcher_fn", "exit_fn", "save_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigError(f"{name} must be callable or None, not {type(value).__name__}")
        if self.exit_fn is None:
            self.exit_fn = exit_process


_freeze_at_exit = False


def exit_process(code: int) -> NoReturn:
    """The default ``exit_fn``: ``sys.exit(code)``, and the interpreter's shutdown without
    its garbage collections over the whole heap.

    Python's finalization runs full collections that traverse every object still alive;
    with torch imported (1,100 modules, 170,000 objects) that cost 0.9 s of CPU here, with
    Lightning (3,300 modules, 390,000 objects) 1.9 s, 2-6 s of wall time on busy cores:
    nearly all of the way out, against a notice's deadline. ``gc.freeze()`` leaves those
    objects out (0.2 and 0.3 s of CPU remain).
    It runs from an atexit hook, so only when the process really ends (a notebook that
    catches the SystemExit keeps a normal collector) and after everything that still runs
    on the way out (finally blocks, Lightning's teardown). Objects are still freed by their
    reference counts, and atexit hooks (trackers, logging, DataLoader workers) run as
    before; only cyclic garbage is left to the OS, as ``os._exit`` would leave it.
    """
    global _freeze_at_exit
    if not _freeze_at_exit:
        _freeze_at_exit = True
        atexit.register(gc.freeze)
    sys.exit(code)


class Durations:
    """Recent durations of one kind (steps, saves, exits) and a pessimistic bound on the next.

    ``prior_spread`` is the spread assumed, as a share of the mean, before the measurements
    can tell it; it weighs as ``PRIOR_WEIGHT`` measurements, so a handful of them decide.
    """

    def __init__(
        self,
        window: int = 16,
        *,
        prior_spread: float = PRIOR_SPREAD,
        values: Iterable[float] = (),
    ) -> None:
        self._values: deque[float] = deque(values, maxlen=window)
        self.prior_spread = prior_spread

    def add(self, seconds: float) -> None:
        self._values.append(seconds)

    def plus(self, seconds: float) -> Durations:
        """A copy with ``seconds`` added to each duration (a save and the upload after it)."""
        added = Durations(self._values.maxlen or 16, prior_spread=self.prior_spread)
        added._values.extend(v + seconds for v in self._values)
        return added

    def __len__(self) -> int:
        return len(self._values)

    def max(self) -> float:
        return max(self._values, default=0.0)

    def median(self) -> float:
        if not self._values:
            return 0.0
        ordered = sorted(self._values)
        return ordered[len(ordered) // 2]

    def mean(self) -> float:
        return sum(self._values) / len(self._values) if self._values else 0.0

    def spread(self) -> float:
        """The standard deviation, pooled with the prior's: with one measurement it is
        ``prior_spread * mean``; with many, the measured one."""
        n = len(self._values)
        if not n:
            return 0.0
        mean = self.mean()
        squares = sum((v - mean) ** 2 for v in self._values)  # (n - 1) * sample variance
        prior = PRIOR_WEIGHT * (self.prior_spread * mean) ** 2
        return math.sqrt((prior + squares) / (PRIOR_WEIGHT + n - 1))

    def bound(self, safety: float) -> float:
        """What the next one may plausibly take: the longest recent one, or mean +
        ``safety * SPREAD_Z`` spreads when that is more. The maximum guards against rare
        stalls that the spread of mostly regular durations understates."""
        if not self._values:
            return 0.0
        return max(self.max(), self.mean() + safety * SPREAD_Z * self.spread())


def _bound(value: float | Durations, safety: float, prior_spread: float) -> float:
    """A bound of a Durations, or of a single number taken as one measurement."""
    if isinstance(value, Durations):
        return value.bound(safety)
    return Durations(prior_spread=prior_spread, values=(value,)).bound(safety)


# weakly: a stop counts while its run's objects live (a script's handler, to the exit), and a
# run stopped long ago in a notebook's process does not bound the exit of the ones after it
_all_requests: weakref.WeakSet[StopRequests] = weakref.WeakSet()


def stops_received() -> list[StopRequests]:
    """Every live ``StopRequests`` of this process that received a stop, even one whose loop
    ended since (a run that trained to its end within the grace period): what an upload at the
    interpreter's exit must still be done by (``_mirror.upload_deadline``)."""
    return [requests for requests in list(_all_requests) if requests.stopping]


class StopRequests:
    """The notices received so far. Appends come from a signal handler or a watcher thread;
    ``list.append`` is atomic under the GIL, so neither needs a lock (a lock taken inside a
    signal handler can deadlock the main thread that already holds it)."""

    def __init__(self, grace_period: float | None = None) -> None:
        self.grace_period = grace_period
        self._notices: list[Notice] = []
        _all_requests.add(self)  # here, not in add(): a signal handler only appends

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
        """When the process must be gone: the earliest deadline of the stopping notices (each
        moved earlier by its ``detection_latency``); ``received_at`` for one without."""
        best: float | None = None
        for n in self.stopping:
            if n.deadline is not None:
                d = n.deadline - n.detection_latency
            elif self.grace_period is not None:
                d = n.received_at + self.grace_period - n.detection_latency
            else:
                d = n.received_at
            best = d if best is None else min(best, d)
        return best

    def must_stop_now(
        self,
        *,
        now: float,
        save_time: float | Durations,
        step_time: float | Durations,
        safety: float,
        exit_time: float | Durations = EXIT_TIME,
    ) -> bool:
        """True when one more step, the final save and the exit might not all fit before the
        deadline (or there is no deadline to wait for: a plain stop request).

        Each duration is the ``Durations`` measured so far (bounded from its mean, spread and
        maximum) or a single number taken as one measurement. A pure function of its inputs
        and the notices: ``now`` is any clock in the notices' time base.
        """
        deadline = self.deadline()
        if deadline is None:
            return False
        if not any(n.deadline is not None for n in self.stopping) and self.grace_period is None:
            return True  # a plain stop request: stop at this boundary
        needed = (
            _bound(step_time, safety, PRIOR_SPREAD)
            + _bound(save_time, safety, PRIOR_SPREAD)
            + _bound(exit_time, safety, EXIT_PRIOR_SPREAD)
            + DECISION_MARGIN
        )
        return now + needed >= deadline


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
