"""The stop sequence: what happens, in order, from a pending stop request to the exit.

This module owns it, once. ``StopSession`` (``_session.py``) keeps the position, the
boundaries, periodic saves and the life cycle; at a boundary with a request pending it hands
the position to its ``StopSequence``, whose methods read top to bottom:

1. decide       one process: the grace policy's answer at this boundary (``stop/_controller``):
                continue, an insurance checkpoint (a notice with time to spare), or stop here;
2. agree        torch.distributed: every rank acts at the same step, whichever rank's request
                came first (``distributed/_agreement``); rank 0's periodic saves in seconds
                are agreed the same way;
3. save         the stop's checkpoint, unless one of this position is committed (``Saves``);
4. record       the run record says "stopping" before the save (a save cut short still tells
                the supervisor a stop was under way), then "stopped" or "save_failed";
5. acknowledge  the platform's notices: the checkpoint is safe;
6. tracker      upload the checkpoint, then finalize once;
7. hold         from here a late signal exits with the stop's code instead of killing a
                process that has already saved;
8. upload       a checkpoint location that is a URL: its upload finishes, by the deadline;
9. exit         the ranks leave together, the front end's last words, close, ``exit_fn``.

What a front end adds to its stop is a ``FrontEnd``: three methods, not callbacks threaded
through the steps. ``stop/`` keeps what is below the kit: the latch, the requests and the
grace policy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .. import _run
from .._errors import CheckpointSaveError
from .._states import RecordState
from ..checkpoint._savers import Saver
from ..distributed._agreement import StopAgreement
from ..distributed._group import Ranks
from ..stop._controller import Decision, StopController
from ..stop._termination import Notice, TerminationConfig
from ._saves import Saves

logger = logging.getLogger("preemptible")


class FrontEnd(Protocol):
    """What a front end adds to its stop."""

    def save_failed(self, exc: Exception) -> Path | None:
        """The stop's save raised ``exc``: return a path to upload anyway (Lightning's
        contract), or None; raise to fail the stop (it records ``save_failed``)."""
        ...

    def after_tracker(self) -> None:
        """The tracker was told: the front end's last word to it (silence a framework's
        loggers, which would finalize the same run a second time)."""
        ...

    def before_exit(self) -> None:
        """The exit comes next: unwind the framework's fit (an ``exit_fn`` may return)."""
        ...


@dataclass(frozen=True)
class GivenFrontEnd:
    """The ``FrontEnd`` of the functions given to ``StopSession`` (each one optional)."""

    on_save_failed: Callable[[Exception], Path | None] | None = None
    on_after_tracker: Callable[[], None] | None = None
    on_before_exit: Callable[[], None] | None = None

    def save_failed(self, exc: Exception) -> Path | None:
        if self.on_save_failed is None:
            raise exc
        return self.on_save_failed(exc)

    def after_tracker(self) -> None:
        if self.on_after_tracker is not None:
            self.on_after_tracker()

    def before_exit(self) -> None:
        if self.on_before_exit is not None:
            self.on_before_exit()


def tracker_status(notice: Notice | None) -> str:
    """What a tracker is told about a stop: Ctrl+C is "killed", everything else "preempted"."""
    if notice is not None and notice.signum == signal.SIGINT:
        return "killed"
    return "preempted"


class StopSequence:
    """The stop sequence of one ``StopSession``. See the module docstring.

    Positions (``at``) are the front end's count of finished steps, ``step`` what a checkpoint
    and the record say; the session passes both. ``ranks`` and ``agreement`` are set by the
    session's ``start()`` under torch.distributed."""

    def __init__(
        self,
        config: TerminationConfig,
        controller: StopController,
        saver: Saver,
        saves: Saves,
        front_end: FrontEnd,
        *,
        exit_code: int | None,
        tracker: Any | None,
    ) -> None:
        self.config = config
        self.controller = controller
        self.requests = controller.requests
        self.latch = controller.latch
        self.saver = saver
        self.saves = saves
        self.front_end = front_end
        self.exit_code = exit_code  # None: the notice's (128 + signum, 143 for a notice)
        self.tracker = tracker
        self.ranks: Ranks | None = None
        self.agreement: StopAgreement | None = None
        self.stopping = False  # the stop's save is under way or done
        self.stopped = False
        self.agreed: Notice | None = None  # the stop every rank agreed on (should_stop)
        self.want_save = False  # rank 0: a periodic save in seconds is due (agreed first)
        self.seen = 0  # signals a boundary saw (and decided about)
        self._tracker_final: str | None = None
        self._locked = False

    # -- 1. decide (one process) -----------------------------------------------------------
    def decide(self, step: int, at: int, context: Any) -> bool:
        """A boundary with a request pending: continue, insurance, or stop here. True when
        the run stopped here (an ``exit_fn`` that returned)."""
        self.seen = len(self.latch.received)
        decision = self.controller.decide(saved_here=self.saves.of(at) is not None)
        if decision is Decision.CONTINUE:
            return False
        if decision is Decision.INSURANCE:
            self.insurance(step, at, context)
            if not self.controller.must_stop_now():
                return False
        self.stop(step, at, context, None)
        return True

    def at_end(self, step: int, at: int, context: Any) -> bool:
        """The end of training: a stop that came after the last step is acted on here."""
        self.seen = len(self.latch.received)
        if self.agreement is not None:
            agreed = self.agreement.at_end(self.requests.first_stop())
            if agreed is None:
                return False
            self.stop(step, at, context, agreed)
            return True
        if self.requests.first_stop() is None:
            return False
        self.latch.log_pending()
        self.stop(step, at, context, None)
        return True

    # -- 2. agree (torch.distributed) ------------------------------------------------------
    def agree(
        self, step: int, at: int, context: Any, *, act: bool, local: Decision | None = None
    ) -> bool:
        """A boundary under torch.distributed: every rank saves and stops where all agree.
        ``act``: stop here when agreed; else remember it (``should_stop``). ``local``: what
        this rank asks for regardless of its requests (``stop()``). True when the agreed stop
        is here."""
        ag = self.agreement
        assert ag is not None
        ctl = self.controller
        if local is None and not ctl.pending and not self.want_save and ag.quiet():
            return False  # the common case: two attribute writes and two truth tests
        self.seen = len(self.latch.received)
        while True:
            wanted = local or Decision.CONTINUE
            if ctl.pending and wanted is Decision.CONTINUE:
                if act:
                    wanted = ctl.decide(saved_here=self.saves.of(at) is not None)
                else:
                    self.latch.log_pending()
                    wanted = Decision.STOP if ctl.must_stop_now() else Decision.CONTINUE
            periodic = wanted is Decision.CONTINUE and self.want_save
            if periodic:
                wanted = Decision.INSURANCE
            agreed = ag.decide(wanted, self.requests.first_stop(), periodic=periodic)
            if agreed.decision is Decision.CONTINUE:
                return False
            if agreed.decision is Decision.INSURANCE:
                self.want_save = False  # any agreed checkpoint here is rank 0's periodic one
                if agreed.periodic and self.saver.background:
                    self.saves.in_background(step, at, context)  # every rank knows
                elif agreed.periodic:
                    try:
                        self.saves.save(step, at, context)
                    except CheckpointSaveError as exc:
                        logger.error("preemptible: checkpoint at the agreed step failed: %s", exc)
                else:
                    self.insurance(step, at, context, reuse=True)
                continue  # the same boundary: a stop may be due right after the save
            self.agreed = agreed.notice
            if act:
                self.stop(step, at, context, agreed.notice)
            return True

    def insurance(self, step: int, at: int, context: Any, *, reuse: bool = False) -> None:
        """A checkpoint now, training goes on (a notice with time to spare). A failure is
        logged, never raised: the final save may still work."""
        try:
            path = self.saves.save(step, at, context, reuse=reuse)
        except Exception as exc:
            logger.error(
                "preemptible: insurance checkpoint failed: %s: %s", type(exc).__name__, exc
            )
            return
        logger.warning(
            "preemptible: insurance checkpoint %s at step %d; training goes on", path, step
        )

    # -- 3. to 8.: the stop ----------------------------------------------------------------
    def stop(self, step: int, at: int, context: Any, agreed: Notice | None) -> None:
        """Save (unless saved here), record, acknowledge, tell the tracker, hold, exit.
        ``agreed``: the stop every rank agreed on: the record, the tracker and the exit code
        tell its story, whichever rank's signal came first."""
        self.saver.wait()  # a save in flight of this very position is the final one
        self.saves.collect()
        self.stopping = True
        record = self.saves.records  # the ranks that do not own the record leave it alone
        saved = self.saves.of(at) if self.ranks is None else None
        notice = agreed or self.requests.first_stop()
        source = notice.source if notice is not None else "stop"
        if saved is None:
            logger.warning(
                "preemptible: %s at step %d: saving %s, then stopping",
                source,
                step,
                self.saver.target(step),
            )
        else:  # this step's checkpoint was committed just before (a periodic save, the Trainer's)
            logger.warning(
                "preemptible: %s at step %d: this step's checkpoint %s is committed; stopping",
                source,
                step,
                saved,
            )
        if notice is None:
            notice = Notice(source="stop", detail="no request recorded")
        if record:  # 4. before the save too
            _run.update_record(
                state=RecordState.STOPPING,
                preempting=True,
                reason=notice.source,
                signum=notice.signum,
                step=step,
            )
        with self.saver.store.pruning_deferred():  # the next run's first save prunes
            path, committed = self._save(step, at, context, saved, record)  # 3.
        if record and committed and path is not None:  # 4.
            _run.update_record(state=RecordState.STOPPED, checkpoint=os.path.abspath(path))
        self._acknowledge()  # 5.
        self.tell_tracker(tracker_status(notice), upload=path)  # 6.
        self.front_end.after_tracker()
        self.latch.log_pending()  # signals that came during the save
        code = self.exit_code if self.exit_code is not None else notice.exit_code
        logger.warning(
            "preemptible: stopped at step %d on %s; checkpoint %s; exiting with %d",
            step,
            notice.source,
            path if committed else None,
            code,
        )
        self.stopped = True
        # 7. From here a late signal (a supervisor's escalation, a second notice, SLURM)
        # exits with ``code`` instead of killing a process that has already saved.
        self.latch.hold_for_exit(code)
        self._flush_uploads()  # 8. before the ranks leave: a launcher ends those left behind
        if self.ranks is not None:  # 9.
            self.ranks.leave_together()
        self.front_end.before_exit()
        self.close()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        exit_fn = self.config.exit_fn or sys.exit
        exit_fn(code)
        # an exit_fn that returns (a notebook, a test): the run goes on without our handlers
        self.latch.restore()

    def _save(
        self, step: int, at: int, context: Any, saved: Path | None, record: bool
    ) -> tuple[Path | None, bool]:
        """The stop's checkpoint and whether it is committed: ``saved`` (one of here), or a
        save now. Under torch.distributed every rank saves (collective; an identical one of
        here is reused). A failed save asks the front end, or records save_failed and raises."""
        if saved is not None:
            return saved, True
        try:
            return self.saves.save(step, at, context, reuse=self.ranks is not None), True
        except Exception as exc:
            try:
                return self.front_end.save_failed(exc), False
            except BaseException:
                if record:  # the stop did not keep its promise: a failure, not a stop
                    _run.update_record(state=RecordState.SAVE_FAILED, error=_one_line(exc))
                raise

    def _flush_uploads(self) -> None:
        """The stop's checkpoint is committed locally; a checkpoint location that is a URL
        uploads it in the background: wait for that upload (and any older one queued) before
        the process exits, or the next machine resumes from an older one. With a deadline (a
        notice's, or the grace period's) the wait ends in time for the exit; an upload that
        cannot finish by then is said in one line naming the newest checkpoint in the bucket
        (the run record's ``remote_checkpoint``), and the exit does not wait again. No mirror
        in this process (no URL was used): nothing to wait for, and nothing is imported."""
        if "preemptible.checkpoint._mirror" not in sys.modules:
            return
        from ..checkpoint._mirror import flush_all, upload_deadline

        flush_all(upload_deadline(self.requests), final=True)

    # -- shared with the session -----------------------------------------------------------
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

    def lock(self) -> None:
        """Take the directory's lock (rank 0: the ranks share its directory); the exit, or
        the session's close, releases it."""
        self.saver.store.lock()
        self._locked = True

    def close(self) -> None:
        """Finish any background save, restore the signal handlers (unless the exit of a
        committed stop is under way), stop the watcher, release the directory; idempotent.
        A run that goes on or ends (not a stop) waits for the removal of what its saves
        pruned, so its directory holds ``keep`` checkpoints when the loop returns."""
        self.saver.close()
        if not self.stopping:
            self.saver.store.wait_for_removals()
        self.controller.close()
        if self.agreement is not None:
            self.agreement.close()
        if self._locked:  # only this run's lock (a front end may keep its store for the next)
            self.saver.store.unlock()
            self._locked = False

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
