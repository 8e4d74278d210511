"""The stop session: one object per run of a front end that owns the whole stop path.

A front end (the plain handler, the Lightning callback, one of your own) knows two things:
where its boundaries are and how its framework saves (a ``Saver``). It calls
``at_boundary(phase)`` at each boundary and ``finished()`` when training ends. The session
holds the run's position and life cycle:

- start and close: rank detection, the saver, the directory lock and stale temporaries, the
  signal latch and the platform watcher (``StopController``), where checkpoints go in the run
  record; resuming from the newest checkpoint that loads;
- the boundaries: the position, the step timing (the grace policy's input), periodic saves
  (``Saves``: commits, their cost, the newest one in the run record), the end of training
  (``finished``: the record, the end committed, the tracker told);
- a boundary with a stop request pending is handed to its ``StopSequence``
  (``_sequence.py``: the stop sequence, from the decision to the exit).

Boundaries are counted in *positions*: the front end's own count of finished training steps
(``step`` by default). A checkpoint is "of here" when it was committed at the current position,
so a stop right after an insurance checkpoint does not write a second one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from .. import _report, _run
from .._errors import PreemptibleError
from .._logs import announce, set_rank
from .._states import RecordState
from ..checkpoint._savers import Saver
from ..checkpoint._store import CheckpointStore
from ..distributed._agreement import StopAgreement, agreement_of
from ..distributed._group import Ranks
from ..stop._controller import Decision, StopController
from ..stop._latch import normalize_signals, patch_dataloader_workers
from ..stop._launcher import warn_if_unforwarded
from ..stop._termination import Durations, Notice, TerminationConfig
from ._config import is_rank_zero, termination_config_of
from ._periodic import Periodic
from ._phase import _END, _STEP, Phase
from ._saves import Saves
from ._sequence import GivenFrontEnd, StopSequence

logger = logging.getLogger("preemptible")


def saves_in(store: CheckpointStore) -> str:
    """Where ``store``'s checkpoints live for a reader elsewhere: its bucket's URL, or its
    directory (absolute)."""
    location = store.location
    return location.url if location is not None else str(store.directory.resolve())


T = TypeVar("T")


class _OfSequence(Generic[T]):
    """An attribute of the session that its stop sequence holds (read here, held once)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, session: StopSession, owner: type | None = None) -> T:
        return cast(T, getattr(session.sequence, self.name))


class StopSession:
    """The stop path of one run of a front end. See the module docstring.

    ``saver``: how checkpoints are written and found. ``termination_config``, ``signals``,
    ``tracker``: as for ``PreemptionCheckpointHandler``. ``periodic``: periodic saves.
    ``exit_code``: the code a stop exits with (None: 128 + signum, 143 for a notice).
    ``save_failed``: called when the final save raises; returns a path to upload anyway (else
    the stop records ``save_failed`` and raises). ``after_tracker`` and ``before_exit``: the
    front end's own last words (silence a framework's loggers; flush). The three are the
    stop sequence's ``FrontEnd``. ``ranks``: the processes of a framework's own process group
    (``Ranks.over(store, rank, world)``; default: torch.distributed's, when initialized).
    """

    # the stop sequence's: the ranks under torch.distributed (after ``start()``), their
    # agreement, the exit code (None: 128 + signum, 143 for a notice), whether the stop's save
    # is under way or done (``stopping``), whether the run stopped
    ranks: _OfSequence[Ranks | None] = _OfSequence()
    agreement: _OfSequence[StopAgreement | None] = _OfSequence()
    exit_code: _OfSequence[int | None] = _OfSequence()
    stopping: _OfSequence[bool] = _OfSequence()
    stopped: _OfSequence[bool] = _OfSequence()

    def __init__(
        self,
        saver: Saver,
        *,
        termination_config: TerminationConfig | None = None,
        signals: Iterable[int | str] | None = None,
        tracker: Any | None = None,
        periodic: Periodic | None = None,
        exit_code: int | None = None,
        save_failed: Callable[[Exception], Path | None] | None = None,
        after_tracker: Callable[[], None] | None = None,
        before_exit: Callable[[], None] | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        self.config = termination_config_of(termination_config)
        self._given_ranks = ranks
        self.saver = saver
        self.store = saver.store
        self.periodic = periodic
        self.controller = StopController(self.config, normalize_signals(signals))
        self.latch = self.controller.latch
        self._step_times = self.controller.step_times  # read at every step: held, not looked up
        self.step = 0  # what a checkpoint and the record say
        _report.follow_steps(self)  # report() without step= reports at this step
        self.resume_path: Path | None = None
        self.saves = Saves(saver, periodic, self.controller.save_times, is_rank_zero())
        if self.store.mirror is not None:
            self.controller.upload_time = self.store.mirror.upload_estimate
        self.sequence = StopSequence(
            self.config,
            self.controller,
            saver,
            self.saves,
            GivenFrontEnd(save_failed, after_tracker, before_exit),
            exit_code=exit_code,
            tracker=tracker,
        )
        self._at = 0  # the current position
        self._boundary = 0  # the position of the last step boundary
        self._left_at: float | None = None  # when the last boundary was left (monotonic)
        self._announced = False
        self._resumed = False
        self._background = False
        self._finished = False  # finished() ran: a signal after it is passed on at close()

    # -- life cycle ------------------------------------------------------------------------
    def start(self, *, handle_signals: bool = True) -> bool:
        """Detect the ranks, attach the saver, lock the directory (rank 0), remove stale
        temporaries, install the signal handlers and start the watcher; record where
        checkpoints go. False when the handlers could not be installed (off the main thread).
        ``handle_signals=False``: neither handlers nor watcher (a process that is not the one
        the front end was made in: its signals are not ours)."""
        seq = self.sequence
        try:
            seq.ranks = ranks = self._given_ranks or Ranks.detect()
            if ranks is not None:
                seq.agreement = agreement_of(ranks)
                set_rank(ranks.rank)
            self.saves.records = self.is_zero
            self.saver.attach(ranks)
            self._background = bool(self.saver.background)  # collect only what can finish
            if self.is_zero:  # under torch.distributed the ranks share rank 0's directory
                seq.lock()
                self.store.clean_stale_temporaries()
            installed = self.controller.start() if handle_signals else False
            if installed:  # a launcher that keeps the signals from us: said at start
                warn_if_unforwarded(supervised=_run.current_run().run_id is not None)
        except BaseException:
            self.close()
            raise
        if self.is_zero:  # the run record has one writer
            # where this attempt really saves, for the supervisor's next PREEMPTIBLE_RESUME_FROM
            # (a bucket's URL: what the next attempt, on any machine, resumes from)
            _run.update_record(checkpoint_dir=saves_in(self.store))
        return installed

    def close(self) -> None:
        """Finish any background save, restore the signal handlers (unless the exit of a
        committed stop is under way), stop the watcher, release the directory; idempotent.

        A signal that arrived after training finished (no boundary was left to act on it) is
        passed on once the handlers that were there before are back: by default it ends the
        process as it would have without preemptible (the run's end is committed, so a rerun
        trains nothing); a handler of the program's own gets it."""
        late = self._finished and not self.stopped  # a signal no boundary saw: pass it on
        self.sequence.close()
        if late:
            self._finished = False  # once
            self.latch.pass_on(self.sequence.seen)

    def begin(self) -> None:
        """Training (re)starts here: resume unless done, guard DataLoader workers (torch may
        have been imported since ``start``)."""
        if not self._resumed:
            self.resume()
        if self.latch.installed:
            patch_dataloader_workers()

    def resume(self) -> int:
        """Restore the newest checkpoint that loads (``PREEMPTIBLE_RESUME_FROM`` counted);
        return the step to start from (0 without one). Collective under torch.distributed."""
        found = self.saver.resume(_run.current_run().resume_from)
        self._resumed = True
        if found is not None:
            step, path = found
            self.note_saved(path, step=step, resumed=True)
        self._left_at = self.saves.last_end = time.monotonic()
        if self.periodic is not None and self.periodic.by_time and not self._announced:
            self._announced = True
            announce("preemptible: periodic saves %s", self.periodic.describe())
        return self.step

    def note_saved(
        self, path: Path, *, step: int, position: int | None = None, resumed: bool = False
    ) -> None:
        """A checkpoint of this position exists already (the one the framework resumed
        from): a stop here does not write another. ``resumed``: this run continues from it
        (said on stderr, even without a logging set-up)."""
        self.step = step
        self._at = self._boundary = step if position is None else position
        self.saves.note(path, self._at)
        if resumed:
            self.resume_path, self.saves.resumed_at = path, self._at
            announce("preemptible: resumed from %s at step %d", path, step)

    # -- state -----------------------------------------------------------------------------
    @property
    def is_zero(self) -> bool:
        ranks = self.sequence.ranks
        return ranks.is_zero if ranks is not None else is_rank_zero()

    @property
    def pending(self) -> bool:
        """Whether any stop request or warning arrived (one truth test)."""
        return self.controller.pending

    @property
    def notices(self) -> list[Notice]:
        return self.controller.requests.notices

    @property
    def step_times(self) -> Durations:
        return self._step_times

    @property
    def save_times(self) -> Durations:
        return self.controller.save_time()

    @property
    def stall_times(self) -> Durations:
        """What the training loop waited for each save (a background save: the copy)."""
        return self.saves.stall_times

    @property
    def saved_here(self) -> bool:
        """A checkpoint of the current position is committed."""
        return self.saves.of(self._at) is not None

    # -- boundaries ------------------------------------------------------------------------
    def at_boundary(
        self,
        phase: Phase = Phase.STEP,
        *,
        step: int | None = None,
        position: int | None = None,
        context: Any = None,
        seconds: float | None = None,
        total: int | None = None,
        act: bool = True,
    ) -> bool:
        """A boundary of ``phase`` at ``step`` (``position``: the front end's own count, by
        default the step). ``seconds``: how long the step took (default: since the last
        boundary). ``total``: the last step (its save point is always due). ``context`` goes to
        the saver. ``act=False``: only time it. True when the run stopped here (an ``exit_fn``
        that returned)."""
        # the per-step path: a few attribute reads, two clock reads, no call that is not needed
        if step is not None:
            self.step = step
        pos = self._at = self.step if position is None else position
        if phase is _STEP:
            if pos != self._boundary:
                self._advance(pos, seconds, total, context)
        elif seconds is not None:
            self._step_times.add(seconds)
        stopped = False
        seq = self.sequence
        if act and not seq.stopped:
            if self._background:
                self.saves.collect()
            if phase is _END:
                stopped = seq.at_end(self.step, pos, context)
            elif seq.agreement is not None:
                stopped = phase is _STEP and seq.agree(self.step, pos, context, act=True)
            elif seq.requests:
                stopped = seq.decide(self.step, pos, context)
        self._left_at = time.monotonic()
        return stopped

    def should_stop(
        self, *, step: int | None = None, position: int | None = None, context: Any = None
    ) -> bool:
        """Whether to stop here, without acting on it (a loop of one's own, which then calls
        ``stop()``). A call after the position moved on is a step boundary: it times the step
        and takes a periodic save that is due. Under torch.distributed every call is a
        boundary of the agreement: call it once per step on every rank."""
        return self._poll(step, position, context, insurance=False) is Decision.STOP

    def decide(
        self, *, step: int | None = None, position: int | None = None, context: Any = None
    ) -> Decision:
        """``should_stop`` for a framework that writes its checkpoints itself after the boundary
        (the Hugging Face Trainer): ``INSURANCE`` asks it for a save (training goes on),
        ``STOP`` for a save and then ``stop()``; ``save(started=...)`` commits what it wrote.
        Under torch.distributed a notice is acted on at the last safe step, with no insurance."""
        return self._poll(step, position, context, insurance=True)

    def _poll(self, step: int | None, pos: int | None, ctx: Any, *, insurance: bool) -> Decision:
        at = self._where(step, pos)
        if at != self._boundary:
            self._advance(at, None, None, ctx)
        self._left_at = time.monotonic()
        seq = self.sequence
        if seq.agreement is not None:
            stop = seq.agreed is not None or seq.agree(self.step, at, ctx, act=False)
            return Decision.STOP if stop else Decision.CONTINUE
        if not self.pending:
            return Decision.CONTINUE
        seq.seen = len(self.latch.received)
        if insurance:
            return self.controller.decide(saved_here=self.saved_here)
        self.latch.log_pending()
        return Decision.STOP if self.controller.must_stop_now() else Decision.CONTINUE

    def stop(
        self,
        *,
        step: int | None = None,
        position: int | None = None,
        context: Any = None,
        source: str = "stop()",
        detail: str = "the program asked to stop",
    ) -> None:
        """Stop here: commit a checkpoint (unless one of here exists), record, exit. Under
        torch.distributed every rank calls it at the same step (or when ``should_stop``)."""
        if self.stopped:
            raise PreemptibleError("this run has already stopped; create a new one")
        at = self._where(step, position)
        seq = self.sequence
        if seq.agreed is None:  # not the stop all ranks agreed on: this rank asks
            self.controller.request_stop(source, detail)
            agreement = seq.agreement
            if agreement is not None and not seq.agree(
                self.step, at, context, act=False, local=Decision.STOP
            ):
                raise PreemptibleError(
                    f"rank {agreement.rank}: under torch.distributed call stop() on every rank "
                    "at the same step, or when should_stop is True; another rank was already "
                    "past this step"
                )
        seq.stop(self.step, at, context, seq.agreed)

    def save(
        self, *, step: int | None = None, context: Any = None, started: float | None = None
    ) -> Path:
        """Commit a checkpoint now (collective under torch.distributed). ``started``: when the
        framework began writing it (``time.monotonic()``): the grace policy budgets it all."""
        self._where(step, None)
        return self.saves.save(self.step, self._at, context, started=started)

    def finished(
        self,
        *,
        step: int | None = None,
        position: int | None = None,
        context: Any = None,
        tell_tracker: bool = True,
        commit: bool = True,
        always: bool = False,
    ) -> None:
        """Training ended without a stop: record it, tell the tracker (``tell_tracker=False``:
        the program goes on with the tracker's run). When this run resumed or saved before its
        end, the end is committed too, so that running the same command again trains nothing
        (collective under torch.distributed); ``commit=False``: the framework saves by itself
        (``StagedSaver``), its own checkpoints are what a rerun resumes.

        ``always``: commit the end even when this run never saved (the plain handler's
        ``steps()``). A stop that lands after the loop (the program writing its results, an
        export) finds no handler left to act on it and ends the attempt, which the supervisor
        classes PREEMPTED: the next attempt must find the last step committed, or it trains
        every step again. It is taken here, at the loop's last boundary, because only here is
        the state the last step's: the code after the loop may change it (an export that
        quantizes the model), and a stop's save in a thread would race it. This commit is
        insurance: when it fails, the run says so and goes on (its training is done)."""
        pos = self._where(step, position)
        if self.stopped:
            return
        started, resumed_at = self.saves.started, self.saves.resumed_at
        if commit and started is not None and started < pos:
            self._save(context)
        elif commit and always and started is None and pos > 0:
            self._commit_end(context)
        elif resumed_at is not None and pos == resumed_at:
            announce(
                "preemptible: %s is of a finished run; nothing left to train", self.resume_path
            )
        self._finished = True
        if self.is_zero:
            _run.update_record(state=RecordState.FINISHED, step=self.step)
        if tell_tracker:
            self.sequence.tell_tracker("finished")

    def _commit_end(self, context: Any) -> None:
        """``finished(always=True)``'s commit of a run that never saved: insurance for a stop
        after the loop; a failure is said, not raised (the training itself is done)."""
        try:
            self._save(context)
        except Exception as exc:
            logger.warning(
                "preemptible: the last step (%d) could not be committed: %s: %s; a stop after "
                "the loop would make the next attempt train again",
                self.step,
                type(exc).__name__,
                exc,
            )

    def failed(self) -> None:
        """Training raised: the tracker is told (once)."""
        self.sequence.tell_tracker("failed")

    # -- internals -------------------------------------------------------------------------
    def _save(self, context: Any) -> Path:
        return self.saves.save(self.step, self._at, context)

    def _where(self, step: int | None, position: int | None) -> int:
        if step is not None:
            self.step = step
        self._at = self.step if position is None else position
        return self._at

    def _advance(self, pos: int, seconds: float | None, total: int | None, context: Any) -> None:
        """A step boundary at ``pos``: time the steps since the last one, save if due."""
        since, left = self._boundary, self._left_at
        self._boundary = pos
        if pos <= since or left is None or self.sequence.stopped:
            return  # the same boundary, or the loop went back (a step set by hand)
        now = time.monotonic()
        self._step_times.add((now - left) / (pos - since) if seconds is None else seconds)
        if self._background:
            self.saves.collect()
        if self.periodic is not None and self.saves.of(pos) is None:  # not saved here already
            self._save_if_due(pos, since, total, context)

    def _save_if_due(self, pos: int, since: int, total: int | None, context: Any) -> None:
        periodic = self.periodic
        if periodic is None or not self.saves.due(pos, since, total):
            return
        ranks = self.sequence.ranks
        if periodic.by_time and ranks is not None and pos != total:
            # a clock is not the same on every rank: rank 0 asks, all save where agreed
            self.sequence.want_save = ranks.is_zero
        elif self.saver.background and pos != total:
            self.saves.in_background(self.step, pos, context)
        else:
            self._save(context)
