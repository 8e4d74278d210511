"""``GracefulInterruptCallback``: the Lightning front end of the kit."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from ..frontend import (
    CheckpointStore,
    NamedSaver,
    Phase,
    StopSession,
    TerminationConfig,
    capture_rng,
    exit_code_of,
    is_url,
    normalize_signals,
    saving_config,
)
from ..trackers import Tracker
from ._resume import ExactResume, run_validation, validation_due
from ._signals import Connector, warn_about_replaced_handlers

logger = logging.getLogger("preemptible")

NAME = "resume.ckpt"


@dataclass(frozen=True)
class _Point:
    """The training state a save records.

    ``rng`` None: the RNG states at the moment of the save. ``loops``: the fit loop's state to
    record instead of the current one (a save during a validation records the training batch
    before it). ``fresh``: no training batch has run yet (sanity check): the checkpoint carries
    no loop state, so the resumed fit starts like a new one, sanity check included.
    ``finished``: the end of a fit that trained to its end (a fit resumed from it trains
    nothing).
    """

    rng: dict[str, Any] | None
    val_due: bool
    loops: dict[str, Any] | None = None
    fresh: bool = False
    finished: bool = False


_PLAIN = _Point(rng=None, val_due=False)


class GracefulInterruptCallback(pl.Callback):
    """Stop a fit cleanly on a signal or a platform notice, save ``save_dir/resume.ckpt``,
    resume exactly.

    Contract (kept from the published callback):

    - ``save_dir`` becomes a ``Path``; ``tracker=None`` skips upload and finalization.
      A URL (``s3://bucket/prefix``, ``gs://``, ``az://``) is a bucket: ``save_dir`` is then
      its local staging directory, where ``resume.ckpt`` is committed as always and from
      where each one is uploaded; the callback's creation brings the newest one committed in
      the bucket there (a new machine), so that ``callback.ckpt_path.exists()`` is true
      exactly when the bucket holds one, and ``ckpt_path`` is its local copy. A stop's
      ``resume.ckpt`` is uploaded before the process exits.
    - ``setup``: stores the trainer for every stage; for "fit", in the process that created
      the callback, saves the current handlers of ``signals``, installs its own, and logs
      ``Added GracefulInterrupt callback`` at INFO. ``signals`` (a new keyword) defaults to the
      set ``PreemptionCheckpointHandler`` handles: SIGINT, SIGTERM, SIGHUP, SIGUSR1 and
      SIGUSR2 (the published callback handled SIGINT and SIGTERM only, so a SLURM
      ``--signal=B:USR1@...`` killed the fit without a checkpoint).
    - first signal: a warning with the checkpoint path; ``resume.ckpt`` saved; with a tracker,
      the checkpoint is uploaded, then the run finalized. A failing step is logged, never
      raised; a failed save does not stop the upload; a failed upload skips the finalization.
    - second signal: a warning and ``os._exit(1)`` at once.
    - a signal in another process than the creator is ignored.
    - after an interrupt the process exits with ``exit_code`` so no later callback's
      train-end hook runs: by default (None) 128 + signum, 143 for a platform notice, which
      schedulers, ``preemptible run`` and sweep agents read as "stopped, resume me";
      ``exit_code=0`` keeps the published callback's contract (a process that exits 0 after
      a stop: only a supervisor that reads the run record knows it was preempted).
    - ``teardown``: for "fit", in the creating process, the saved handlers are restored.

    ``termination_config``: how notices arrive (default: the detected platform's watchers and
    grace period, as for ``PreemptionCheckpointHandler``); its ``exit_fn`` replaces
    ``sys.exit``. A handler of one of ``signals`` installed before ``fit()`` is not called
    during the fit (a warning names it) and is back when the fit ends. Lightning's SLURM
    auto-requeue handler (SIGUSR1 by default) is then not installed: Lightning adds it only
    where no handler is set, and the callback takes its signals back in any case.

    One fit writes to a ``save_dir`` at a time (a second one raises ``CheckpointLockError``).
    A fit that resumed (or saved) and then trains to its end commits that end to
    ``resume.ckpt``, so that the same command run again trains nothing.

    Resume with ``trainer.fit(model, ckpt_path=callback.ckpt_path)``.
    """

    def __init__(
        self,
        save_dir: Path | str,
        tracker: Tracker | None = None,
        *,
        exit_code: int | None = None,
        signals: list[int | str] | None = None,
        termination_config: TerminationConfig | None = None,
    ) -> None:
        super().__init__()
        # a bucket: its store is made now, which brings the newest checkpoint committed there
        # into the staging directory before the script looks at ckpt_path
        self._store = CheckpointStore(save_dir) if is_url(save_dir) else None
        self.save_dir = self._store.directory if self._store is not None else Path(save_dir)
        self.tracker = tracker
        self.exit_code = exit_code_of(exit_code)
        # None: the same set as PreemptionCheckpointHandler (INT, TERM, HUP, USR1, USR2)
        self.signals = normalize_signals(signals or None)
        self.termination_config = saving_config(
            termination_config, "GracefulInterruptCallback (Lightning saves resume.ckpt itself)"
        )
        self.trainer: pl.Trainer | None = None
        self._creator = os.getpid()
        self._session: StopSession | None = None
        self._connector: Connector | None = None
        self._resume = ExactResume(self._run_due_validation)
        self._batches = 0  # training batches of this fit in this process: the position
        self._batch_started = 0.0
        self._validates = False  # this fit has a validation loop
        self._point: _Point | None = None  # the last training batch, while a validation runs
        self._saving: _Point | None = None

    @property
    def ckpt_path(self) -> Path:
        return self.save_dir / NAME

    @property
    def state_key(self) -> str:
        return "GracefulInterruptCallback"

    # -- contract hooks ------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.trainer = trainer
        if stage != "fit":
            return
        self._batches = 0
        self._point = self._saving = None
        self._trained = self._ended = False
        self._resume.setup(trainer)
        if self._session is not None:  # a new fit after a stop whose SystemExit was caught
            self._session.close()
            self._session.latch.restore()
        rank_zero = int(getattr(trainer, "global_rank", 0)) == 0
        store = self._store if self._store is not None else CheckpointStore(self.save_dir)
        saver = NamedSaver(store, NAME, self._write, writer=trainer.is_global_zero)
        quiet = rank_zero and self.tracker is not None
        session = StopSession(
            saver,
            termination_config=self.termination_config,
            signals=self.signals,
            tracker=self.tracker if rank_zero else None,
            exit_code=self.exit_code,
            save_failed=self._save_failed,
            # Lightning finalizes its loggers with "failed" on the way out; for a logger on
            # the same run as the tracker that would be a second, wrong, final status
            after_tracker=(lambda: _quiet_loggers(trainer)) if quiet else None,
            before_exit=lambda: self._before_exit(trainer),
        )
        self._session = session
        self._connector = Connector(trainer, session.latch)
        ours = os.getpid() == self._creator
        if session.start(handle_signals=ours) and ours:
            warn_about_replaced_handlers(session.latch)
            self._connector.wrap_registration()
        if ours:
            logger.info("Added GracefulInterrupt callback")

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_back()
        self._resume.sanity_check_start()
        if trainer.world_size == 1:
            # the sanity check runs under Lightning's isolate_rng: the RNG after it is this one
            self._point = _Point(rng=capture_rng(), val_due=False, fresh=True)

    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._point = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_back()
        self._validates = bool(trainer.enable_validation)  # Lightning's test costs ~10 us
        self._trained = True
        session = self._session
        if session is not None and self._is_ours(trainer.ckpt_path):
            # resumed from our checkpoint: a stop before the next batch need not save again,
            # and the fit's end is committed so that a rerun trains nothing
            session.note_saved(
                self.ckpt_path, step=trainer.global_step, position=self._batches, resumed=True
            )
        self._resume.train_start(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resume.epoch_start(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._resume.restore_pending_rng()
        self._point = None
        self._batch_started = time.monotonic()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._batches += 1
        session = self._session
        if session is None or session.stopped:
            return
        due = self._validates and validation_due(trainer)
        if session.at_boundary(
            Phase.STEP,
            step=trainer.global_step,
            position=self._batches,
            context=_Point(rng=None, val_due=due),
            seconds=time.monotonic() - self._batch_started,
        ):
            return
        if due and trainer.world_size == 1:  # a stop during that validation saves this batch
            self._point = _Point(
                rng=capture_rng(), val_due=True, loops=trainer.fit_loop.state_dict()
            )

    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_started = time.monotonic()

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        session, point = self._session, self._point
        if session is None or trainer.state.fn != "fit":
            return
        # A validation batch counts as a step for the grace policy: after a training batch
        # with a validation due, the next boundary is one validation batch away. A stop is
        # acted on only where a checkpoint can record the fit (_point: one process, in a fit's
        # validation or its sanity check).
        session.at_boundary(
            Phase.EVALUATION,
            step=trainer.global_step,
            position=self._batches,
            context=point,
            seconds=time.monotonic() - self._batch_started,
            act=point is not None,
        )

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._point = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The last place a stop can be seen: one that came after the last training batch
        # (final validation, epoch-end hooks) saves the finished state and exits.
        session = self._session
        self._ended = True
        if session is None or session.stopped:
            return
        # what the fit did: its batches, and what the resume ran again of the saved fit (a
        # due validation, an epoch's end), which the checkpoint it resumed from does not hold
        step, position = trainer.global_step, self._batches + self._resume.replayed
        if session.at_boundary(Phase.END, step=step, position=position, context=_PLAIN):
            return
        # the fit's own end: no tracker finalization (the script may go on with the run)
        session.finished(
            step=step,
            position=position,
            context=_Point(rng=None, val_due=False, finished=True),
            tell_tracker=False,
        )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A fit resumed from a checkpoint of a finished fit: Lightning returns at once, before
        # on_train_start (no batch, no on_train_end). Say so, and record the run finished.
        session = self._session
        if session is None or session.stopped or self._trained or self._ended:
            return
        if self._is_ours(trainer.ckpt_path):
            session.note_saved(self.ckpt_path, step=trainer.global_step, position=0, resumed=True)
            session.finished(step=trainer.global_step, position=0, tell_tracker=False)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        session = self._session
        ours = isinstance(exception, SystemExit) and session is not None and session.stopped
        self._resume.unwrap()
        self._close()
        if not ours and session is not None:
            session.failed()  # rank 0 only: the others have no tracker

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._resume.unwrap()
        if stage == "fit" and os.getpid() == self._creator:
            self._close()

    def state_dict(self) -> dict[str, Any]:
        point = self._saving or _PLAIN
        session = self._session
        return {
            "rng": point.rng if point.rng is not None else capture_rng(),
            "epoch_rng": None if point.fresh else self._resume.epoch_rng,
            "interrupted": session is not None and session.stopping,
            "val_due": point.val_due,
            "fresh": point.fresh,
            "finished": point.finished,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume.load(state_dict)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        point = self._saving
        if point is None:
            return
        if point.fresh:
            checkpoint.pop("loops", None)
        elif point.loops is not None:
            checkpoint["loops"]["fit_loop"] = point.loops

    # -- saving ----------------------------------------------------------------------------
    def _write(self, tmp: Path, step: int, point: _Point | None) -> None:
        """The saver's write: Lightning's own checkpoint, recording ``point``. Every rank
        calls it (the save is a collective under DDP); only global rank 0 writes a file."""
        assert self.trainer is not None
        self._saving = point or _PLAIN
        try:
            self.trainer.save_checkpoint(tmp, weights_only=False)  # the whole fit, said so
        finally:
            self._saving = None

    def _save_failed(self, exc: Exception) -> Path:
        logger.error(
            "preemptible: saving %s failed: %s: %s", self.ckpt_path, type(exc).__name__, exc
        )
        return self.ckpt_path  # the contract: the upload is still attempted

    def _run_due_validation(self, trainer: pl.Trainer) -> None:
        """Run the validation the checkpoint marked due. A stop during it keeps that
        checkpoint, which records exactly this state, when it is ``resume.ckpt``."""
        session = self._session
        if trainer.world_size == 1 and self._is_ours(trainer.ckpt_path) and session is not None:
            self._point = _Point(rng=None, val_due=True)
            session.note_saved(self.ckpt_path, step=trainer.global_step, position=self._batches)
        run_validation(trainer)
        self._point = None

    def _is_ours(self, path: Any) -> bool:
        return path is not None and Path(path).resolve() == self.ckpt_path.resolve()

    # -- signals ---------------------------------------------------------------------------
    def _take_back(self) -> None:
        if self._connector is not None:
            self._connector.take_back()

    def _before_exit(self, trainer: pl.Trainer) -> None:
        trainer.should_stop = True  # an exit_fn that returns: the fit ends here
        if self._connector is not None:
            self._connector.keep_for_exit()

    def _close(self) -> None:
        if self._session is not None:
            self._session.close()  # a latch holding for the exit keeps its handlers to the end
        if self._connector is not None:
            self._connector.unwrap()


def _quiet_loggers(trainer: pl.Trainer) -> None:
    for lg in trainer.loggers:
        lg.finalize = _saver(getattr(lg, "save", None))  # type: ignore[method-assign]


def _saver(save: Any) -> Any:
    def finalize(status: str) -> None:
        if save is not None:
            save()

    return finalize


__all__ = ["GracefulInterruptCallback"]
