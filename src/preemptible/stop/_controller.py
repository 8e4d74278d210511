"""The stop controller: one stop path for every front end.

A front end (``PreemptionCheckpointHandler``, the Lightning callback, the next ones) knows two
things: where its step boundaries are and how to save. Everything else about a stop lives
here, once:

- the signal latch and the watcher (platform notices by default), feeding one list of stop
  requests;
- the boundary decision: continue, write an insurance checkpoint (a notice with time to
  spare), or stop now (the grace policy says one more step would risk the deadline);
- the finish sequence: run record "stopping" -> save -> record "stopped" -> acknowledge the
  notices -> tracker upload + finalize once -> hold the exit code -> exit.

The per-step cost when nothing is pending is one truth test of a list (``pending``).
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import _run
from .._states import RecordState
from ._latch import SignalLatch, patch_dataloader_workers
from ._launcher import warn_if_unforwarded
from ._termination import Durations, Notice, StopRequests, TerminationConfig, Watcher

logger = logging.getLogger("preemptible")


class Decision(enum.Enum):
    CONTINUE = "continue"
    INSURANCE = "insurance"  # save now, keep training
    STOP = "stop"  # save (unless saved here already), then exit


def tracker_status(notice: Notice | None) -> str:
    """What a tracker is told about a stop: Ctrl+C is "killed", everything else "preempted"."""
    if notice is not None and notice.signum == signal.SIGINT:
        return "killed"
    return "preempted"


class StopController:
    """Signals, notices, the grace policy and the finish sequence for one front end."""

    def __init__(
        self,
        config: TerminationConfig,
        signals: tuple[int, ...],
        *,
        tracker: Any | None = None,
    ) -> None:
        self.config = config
        self.tracker = tracker
        self.requests = StopRequests(config.grace_period)
        self.latch = SignalLatch(signals, self.requests.add)
        self.watcher: Watcher | None = None
        self.step_times = Durations()
        self.save_times = Durations()
        self.stopped = False
        self._acted_on = 0
        self._tracker_final: str | None = None

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> bool:
        """Install the signal handlers and start the watcher; False when the handlers could
        not be installed here (off the main thread: it warned, the watcher still runs)."""
        installed = self.latch.install()
        if installed:
            patch_dataloader_workers()
            warn_if_unforwarded()  # a launcher that keeps the signals from us: said at start
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

    def must_stop_now(self) -> bool:
        # the measured durations themselves: the policy budgets from their mean and spread
        exit_time = self.config.exit_time
        return self.requests.must_stop_now(
            now=time.time(),
            save_time=self.save_times,
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

    # -- the finish sequence ---------------------------------------------------------------
    def finish(
        self,
        *,
        step: int,
        save: Callable[[], Path],
        saved: Path | None = None,
        save_failed: Callable[[Exception], Path | None] | None = None,
        after_tracker: Callable[[], None] | None = None,
        record: bool = True,
        notice: Notice | None = None,
    ) -> tuple[Notice, Path | None]:
        """Record, save (unless ``saved``), record, acknowledge, tell the tracker. Returns the
        stop's notice and the checkpoint. A failed save raises, unless ``save_failed`` handles
        it: it returns the path to upload anyway (Lightning's contract), or None. ``record``:
        False on the ranks that do not own the run record (two writers would race).
        ``notice``: the stop every rank agreed on (torch.distributed), when it is not this
        rank's own first request: the record, the tracker and the exit code all tell its story."""
        if notice is None:
            notice = self.requests.first_stop()
        if notice is None:
            notice = Notice(source="stop", detail="no request recorded")
        # Written before the save too: if the save is cut short (second signal, SIGKILL at
        # the end of a grace window), the supervisor still knows a stop was under way.
        if record:
            _run.update_record(
                state=RecordState.STOPPING,
                preempting=True,
                reason=notice.source,
                signum=notice.signum,
                step=step,
            )
        path, committed = saved, saved is not None
        if path is None:
            try:
                path, committed = save(), True
            except Exception as exc:
                if save_failed is None:
                    if record:  # the stop did not keep its promise: a failure, not a stop
                        _run.update_record(state=RecordState.SAVE_FAILED, error=_one_line(exc))
                    raise
                path = save_failed(exc)
        if record and committed and path is not None:
            _run.update_record(state=RecordState.STOPPED, checkpoint=os.path.abspath(path))
        self._acknowledge()
        self.tell_tracker(tracker_status(notice), upload=path)
        if after_tracker is not None:
            after_tracker()
        self.latch.log_pending()  # signals that came during the save
        self.stopped = True
        return notice, (path if committed else None)

    def hold_and_exit(self, code: int) -> None:
        """Hold ``code`` (a late signal exits with it), close, call ``exit_fn``; when that
        returns (a notebook, a test), the run goes on without our handlers."""
        self.latch.hold_for_exit(code)
        self.close()
        exit_fn = self.config.exit_fn or sys.exit
        exit_fn(code)
        self.latch.restore()

    def tell_tracker(self, status: str, *, upload: Path | None = None) -> None:
        """Upload, then finalize once. A failing step is logged, never raised (the checkpoint
        matters more); a failed upload skips the finalization (the published contract)."""
        tracker = self.tracker
        if tracker is None or self._tracker_final is not None:
            return
        if upload is not None and not _tracker_call("upload", tracker.upload_checkpoint, upload):
            return
        if _tracker_call("finalize", tracker.finalize, status):
            self._tracker_final = status

    def _acknowledge(self) -> None:
        for n in self.requests.notices:
            if n.acknowledge is not None:
                try:
                    n.acknowledge()
                except Exception as exc:  # the checkpoint is safe; the platform just waits
                    logger.warning("preemptible: could not acknowledge %s: %s", n.source, exc)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:500]


def _tracker_call(what: str, fn: Callable[..., Any], *args: Any) -> bool:
    try:
        fn(*args)
    except Exception as exc:
        logger.error("preemptible: tracker %s failed: %s: %s", what, type(exc).__name__, exc)
        return False
    return True
