"""The stop controller: where stop requests come from and what the grace policy makes of them.

- the signal latch and the watcher (platform notices by default), feeding one list of stop
  requests;
- the boundary decision: continue, write an insurance checkpoint (a notice with time to
  spare), or stop now (the grace policy says one more step would risk the deadline).

What a stop then does, in order, is the kit's stop sequence (``frontend/_sequence.py``).
The per-step cost when nothing is pending is one truth test of a list (``pending``).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from ._latch import SignalLatch, patch_dataloader_workers
from ._termination import Durations, Notice, StopRequests, TerminationConfig, Watcher


class Decision(enum.Enum):
    CONTINUE = "continue"
    INSURANCE = "insurance"  # save now, keep training
    STOP = "stop"  # save (unless saved here already), then exit


class StopController:
    """Signals, notices and the grace policy for one front end."""

    def __init__(self, config: TerminationConfig, signals: tuple[int, ...]) -> None:
        self.config = config
        self.requests = StopRequests(config.grace_period)
        self.latch = SignalLatch(signals, self.requests.add)
        self.watcher: Watcher | None = None
        self.step_times = Durations()
        self.save_times = Durations()
        # how long a checkpoint's upload takes, when the checkpoints go to a bucket: a stop
        # waits for it before the exit, so the policy budgets it with each save
        self.upload_time: Callable[[], float | None] | None = None
        self._acted_on = 0

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> bool:
        """Install the signal handlers and start the watcher; False when the handlers could
        not be installed here (off the main thread: it warned, the watcher still runs)."""
        installed = self.latch.install()
        if installed:
            patch_dataloader_workers()
        fn = self.config.termination_watcher_fn
        if fn is not None and self.watcher is None:
            self.watcher = Watcher(fn, self.requests.add, interval=self.config.poll_interval)
            self.watcher.start()
        return installed

    def close(self) -> None:
        """Restore the handlers (unless the exit of a committed stop is under way) and stop the
        watcher; safe to call more than once."""
        if not self.latch.holding:
            self.latch.restore()  # off the main thread it warns; a later close() restores
        if self.watcher is not None:
            self.watcher.stop()

    # -- the boundary ----------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """Whether any stop request or warning arrived (cheap: for every step)."""
        return bool(self.requests)

    def save_time(self) -> Durations:
        """What a stop's save costs the grace policy: each save measured, plus the upload as
        known now (an insurance checkpoint is saved before any upload was measured; its own
        upload, done or under way by the notice's boundary, then counts)."""
        upload = None if self.upload_time is None else self.upload_time()
        return self.save_times if upload is None else self.save_times.plus(upload)

    def must_stop_now(self) -> bool:
        # the measured durations themselves: the policy budgets from their mean and spread
        exit_time = self.config.exit_time
        return self.requests.must_stop_now(
            now=time.time(),
            save_time=self.save_time(),
            step_time=self.step_times,
            safety=self.config.safety_factor,
            **({} if exit_time is None else {"exit_time": exit_time}),
        )

    def decide(self, *, saved_here: bool) -> Decision:
        """At a boundary: what to do about the requests received so far. ``saved_here``: a
        checkpoint of the current step is already committed."""
        if not self.requests:
            return Decision.CONTINUE
        self.latch.log_pending()
        notices = self.requests.notices
        new, self._acted_on = notices[self._acted_on :], len(notices)
        if self.must_stop_now():
            return Decision.STOP
        if new and not saved_here:
            # A notice with time to spare (or an early warning): an insurance checkpoint
            # now, which also measures how long the final one will take.
            return Decision.INSURANCE
        return Decision.CONTINUE

    def request_stop(self, source: str, detail: str = "") -> None:
        """A stop asked for by the program itself (``handler.stop()``): acted on at once."""
        if self.requests.first_stop() is None:
            self.requests.add(Notice(source=source, detail=detail))
