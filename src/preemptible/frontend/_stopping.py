"""What a stop session does once a stop is due: the acting half of ``StopSession``.

``Stopping`` is a mixin of ``StopSession`` (``_session.py``), which holds the state, the life
cycle and the boundaries; here is what a boundary does about a pending request: decide in one
process (continue, an insurance checkpoint, stop), agree with every rank under
torch.distributed (the stop's step, rank 0's periodic saves in seconds), the insurance
checkpoint, and the stop itself: its save (unless one of here exists), the record, the
tracker, the exit code, late signals held for the exit, leaving together, ``exit_fn``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointSaveError
from ..checkpoint._savers import Saver
from ..distributed._agreement import StopAgreement
from ..distributed._group import Ranks
from ..stop._controller import Decision, StopController
from ..stop._latch import SignalLatch
from ..stop._termination import Notice, TerminationConfig
from ._saves import Saves

logger = logging.getLogger("preemptible")


class Stopping:
    """Acting on stops, for ``StopSession`` (a mixin: ``StopSession`` sets all of these)."""

    config: TerminationConfig
    saver: Saver
    saves: Saves
    controller: StopController
    latch: SignalLatch
    ranks: Ranks | None
    agreement: StopAgreement | None
    exit_code: int | None
    step: int
    stopping: bool
    stopped: bool
    _at: int
    _seen: int
    _want_save: bool
    _agreed_stop: Notice | None
    _save_failed: Callable[[Exception], Path | None] | None
    _after_tracker: Callable[[], None] | None
    _before_exit: Callable[[], None] | None

    if TYPE_CHECKING:

        @property
        def is_zero(self) -> bool: ...

        @property
        def saved_here(self) -> bool: ...

        def close(self) -> None: ...

    def _decide(self, context: Any) -> bool:
        """One process, a request pending: continue, insurance, or stop here."""
        decision = self.controller.decide(saved_here=self.saved_here)
        if decision is Decision.CONTINUE:
            return False
        if decision is Decision.INSURANCE:
            self._insurance(context)
            if not self.controller.must_stop_now():
                return False
        self._stop(context, None)
        return True

    def _at_end(self, context: Any) -> bool:
        ctl = self.controller
        self._seen = len(self.latch.received)
        if self.agreement is not None:
            agreed = self.agreement.at_end(ctl.requests.first_stop())
            if agreed is None:
                return False
            self._stop(context, agreed)
            return True
        if ctl.requests.first_stop() is None:
            return False
        self.latch.log_pending()
        self._stop(context, None)
        return True

    def _agree(self, *, act: bool, context: Any, local: Decision | None = None) -> bool:
        """A boundary under torch.distributed: every rank saves and stops where all agree.
        ``act``: stop here when agreed; else remember it (``should_stop``). ``local``: what
        this rank asks for regardless of its requests (``stop()``). True when the agreed stop
        is here."""
        ag = self.agreement
        assert ag is not None
        ctl = self.controller
        if local is None and not ctl.pending and not self._want_save and ag.quiet():
            return False  # the common case: two attribute writes and two truth tests
        self._seen = len(self.latch.received)
        while True:
            wanted = local or Decision.CONTINUE
            if ctl.pending and wanted is Decision.CONTINUE:
                if act:
                    wanted = ctl.decide(saved_here=self.saved_here)
                else:
                    self.latch.log_pending()
                    wanted = Decision.STOP if ctl.must_stop_now() else Decision.CONTINUE
            periodic = wanted is Decision.CONTINUE and self._want_save
            if periodic:
                wanted = Decision.INSURANCE
            agreed = ag.decide(wanted, ctl.requests.first_stop(), periodic=periodic)
            if agreed.decision is Decision.CONTINUE:
                return False
            if agreed.decision is Decision.INSURANCE:
                self._want_save = False  # any agreed checkpoint here is rank 0's periodic one
                if agreed.periodic and self.saver.background:
                    self.saves.in_background(self.step, self._at, context)  # every rank knows
                elif agreed.periodic:
                    try:
                        self._save(context)
                    except CheckpointSaveError as exc:
                        logger.error("preemptible: checkpoint at the agreed step failed: %s", exc)
                else:
                    self._insurance(context, reuse=True)
                continue  # the same boundary: a stop may be due right after the save
            self._agreed_stop = agreed.notice
            if act:
                self._stop(context, agreed.notice)
            return True

    def flush_uploads(self) -> None:
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

        flush_all(upload_deadline(self.controller.requests), final=True)

    def _insurance(self, context: Any, *, reuse: bool = False) -> None:
        """A checkpoint now, training goes on (a notice with time to spare). A failure is
        logged, never raised: the final save may still work."""
        try:
            path = self._save(context, reuse=reuse)
        except Exception as exc:
            logger.error(
                "preemptible: insurance checkpoint failed: %s: %s", type(exc).__name__, exc
            )
            return
        logger.warning(
            "preemptible: insurance checkpoint %s at step %d; training goes on", path, self.step
        )

    def _save(self, context: Any, *, reuse: bool = False) -> Path:
        return self.saves.save(self.step, self._at, context, reuse=reuse)

    def _stop(self, context: Any, agreed: Notice | None) -> None:
        """Save (unless saved here), record, tell the tracker, exit. ``agreed``: the stop every
        rank agreed on: its code is every rank's exit code, whichever rank's signal came first."""
        self.saver.wait()  # a save in flight of this very position is the final one
        self.saves.collect()
        ranks, ctl = self.ranks, self.controller
        self.stopping = True
        saved = self.saves.of(self._at) if ranks is None else None
        first = agreed or ctl.requests.first_stop()
        logger.warning(
            "preemptible: %s: %s %s at step %d, then stopping",
            first.source if first is not None else "stop",
            "saving" if saved is None else "already saved",
            self.saver.target(self.step) if saved is None else saved,
            self.step,
        )
        notice, path = ctl.finish(
            step=self.step,
            save=lambda: self._save(context, reuse=ranks is not None),
            saved=saved,
            save_failed=self._save_failed,
            after_tracker=self._after_tracker,
            record=self.is_zero,
            notice=agreed,  # the record and the tracker tell the agreed stop's story
        )
        code = self.exit_code if self.exit_code is not None else notice.exit_code
        logger.warning(
            "preemptible: stopped at step %d on %s; checkpoint %s; exiting with %d",
            self.step,
            notice.source,
            path,
            code,
        )
        self.stopped = True
        # From here a late signal (a supervisor's escalation, a second notice, SLURM) exits
        # with ``code`` instead of killing a process that has already saved.
        self.latch.hold_for_exit(code)
        self.flush_uploads()  # before the ranks leave: a launcher ends those left behind
        if ranks is not None:
            ranks.leave_together()
        if self._before_exit is not None:
            self._before_exit()
        self.close()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        exit_fn = self.config.exit_fn or sys.exit
        exit_fn(code)
        # an exit_fn that returns (a notebook, a test): the run goes on without our handlers
        self.latch.restore()
