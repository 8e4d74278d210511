"""``GracefulInterruptCallback``: Lightning fits that stop cleanly and resume exactly.

The callback is a front end of the stop controller (``_controller.py``), like
``PreemptionCheckpointHandler``: the controller owns the signal latch, the platform watcher,
the grace policy and the finish sequence (record, save, record, acknowledge, tracker, exit).
The callback only says where a Lightning fit has boundaries and how to save there. So a fit
gets every platform notice (GCE, EC2, Azure, SLURM time limit, stop file) and the grace
policy: an insurance ``resume.ckpt`` when a notice leaves time, the final one at the last safe
batch.

Where a stop is acted on, and why there:

- after a training batch: the normal boundary; under DDP all ranks agree on the batch through
  the process group's key-value store (a write when a rank stops, a background poll, never a
  collective per batch);
- after a validation batch inside a fit (including the sanity check): waiting for the whole
  pass can eat a notice window. The checkpoint records the last finished training batch with
  the validation marked due, so the resumed fit runs that pass first (single process only:
  DDP ranks are not in lockstep during validation);
- at ``on_train_end``: a stop that arrived after the last training batch (final validation,
  epoch-end hooks) still saves and exits instead of being dropped.

Lightning installs its own SIGTERM handler at the start of every fit (after ``setup``); the
callback takes SIGTERM back right after that registration, so a SIGTERM is never Lightning's
(``trainer.received_sigterm`` stays False, no ``SIGTERMException``), the sanity check included.

``resume.ckpt`` is committed like every other checkpoint: a temporary in the same directory,
fsync, rename, directory fsync. Lightning's own save goes through an fsspec transaction whose
temporary lives in /tmp (a copy, not a rename, across file systems) and is never fsynced; on a
spot VM that powers off right after the exit, such a file can be empty or missing.

RNG states travel in the callback's ``state_dict`` and are put back at the moment that keeps
the resumed fit's draws aligned with an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import torch

from ._errors import ConfigError
from ._files import fsync_dir, fsync_path, host_tag
from ._files import pid_alive as _pid_alive
from .checkpoint._state import capture_rng, restore_rng
from .distributed._group import Ranks, StopAgreement
from .stop._controller import Decision, StopController
from .stop._latch import normalize_signals, signal_name
from .stop._termination import Notice, TerminationConfig
from .trackers import Tracker

logger = logging.getLogger("preemptible")


@dataclass(frozen=True)
class _Point:
    """The training state a save records.

    ``rng`` None: the RNG states at the moment of the save. ``loops``: the fit loop's state to
    record instead of the current one (a save during a validation records the training batch
    before it). ``fresh``: no training batch has run yet (sanity check): the checkpoint carries
    no loop state, so the resumed fit starts like a new one, sanity check included.
    """

    rng: dict[str, Any] | None
    val_due: bool
    loops: dict[str, Any] | None = None
    fresh: bool = False


class _SkipFirst:
    """A DataLoader stand-in whose next iterator starts ``skip`` batches in (once)."""

    def __init__(self, loader: Any, skip: int) -> None:
        self._loader = loader
        self._skip = skip

    def __iter__(self) -> Any:
        iterator = iter(self._loader)
        skip, self._skip = self._skip, 0
        for _ in range(skip):
            next(iterator)
        return iterator

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _skip_first_batches(trainer: pl.Trainer, skip: int) -> None:
    combined = trainer.fit_loop._combined_loader
    if combined is None:
        return
    loaders = combined.flattened
    if any(hasattr(dl, "state_dict") and hasattr(dl, "load_state_dict") for dl in loaders):
        return  # a stateful loader restores its own position (Lightning's "combined_loader")
    combined.flattened = [_SkipFirst(dl, skip) for dl in loaders]


def _saver(save: Any) -> Any:
    def finalize(status: str) -> None:
        if save is not None:
            save()

    return finalize


def _lightning_iterates(trainer: pl.Trainer) -> bool:
    """Whether Lightning will create the epoch's iterator itself after the current hook
    (its own condition in ``_TrainingEpochLoop.on_run_start``)."""
    loop = trainer.fit_loop
    return trainer.current_epoch > 0 and not loop.is_resuming and not loop.epoch_loop.restarting


def _run_validation(trainer: pl.Trainer) -> None:
    """Run the validation that was due when the fit stopped, as the training loop would."""
    loop = trainer.fit_loop.epoch_loop
    loop.val_loop.restarting = False  # a fresh pass, not the end of the one saved earlier
    trainer.validating = True
    loop.val_loop.run()
    trainer.training = True


def _ended_on_restore(trainer: pl.Trainer) -> bool:
    """Whether Lightning's restore counted the saved epoch as ended without running its end.

    A checkpoint saved after an epoch's last training batch (``on_train_batch_end``) is, to
    Lightning's restart (``_FitLoop.reset``), the end of that epoch: it marks the epoch
    processed and completed and goes on with the next one. What the uninterrupted fit ran
    between that batch and the next epoch never runs: the validation after the batch, the
    epoch's ``on_train_epoch_end`` hooks (where ``ModelCheckpoint`` saves when it saves per
    epoch, and ``EarlyStopping`` checks), the epoch's plateau schedulers, and the next epoch's
    ``on_train_epoch_start`` hooks. This is Lightning's own condition for that shortcut."""
    loop = trainer.fit_loop
    epoch_loop = loop.epoch_loop
    return bool(
        loop.restarted_mid_epoch
        and epoch_loop.restarted_on_train_batch_end
        and epoch_loop.batch_progress.is_last_batch
    )


def _shift(progress: Any, field: str, by: int) -> None:
    """Move one counter of a Lightning progress tracker, in its total and current records."""
    for record in (progress.total, progress.current):
        setattr(record, field, getattr(record, field) + by)


@contextlib.contextmanager
def _after_the_saved_batch(trainer: pl.Trainer) -> Any:
    """Lightning's counters as the uninterrupted fit had them after the saved training batch
    ended, while what followed that batch runs again; put back as Lightning's restart expects
    them afterwards (it counts the end of that batch itself, in ``_TrainingEpochLoop.reset``).

    So ``trainer.current_epoch`` is the saved batch's epoch, and a checkpoint written meanwhile
    (``ModelCheckpoint``) records the loops as the uninterrupted fit's did."""
    batches = trainer.fit_loop.epoch_loop.batch_progress
    _shift(batches, "completed", 1)
    try:
        yield
    finally:
        _shift(batches, "completed", -1)


def _recreate_iterator(trainer: pl.Trainer) -> None:
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        iter(fetcher)


def _validation_due(trainer: pl.Trainer) -> bool:
    """Whether Lightning runs a validation pass after the current training batch (its own
    test, in ``_TrainingEpochLoop.on_advance_end``)."""
    try:
        loop: Any = trainer.fit_loop.epoch_loop
        return bool(loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
    except Exception:  # a Lightning without it: a validation due is then not rerun on resume
        return False


def _choose_config(config: TerminationConfig | None) -> TerminationConfig:
    if config is None:
        from .notices import default_config

        return default_config()  # the detected platform's watchers and grace period
    if not isinstance(config, TerminationConfig):
        raise ConfigError(
            f"termination_config must be a TerminationConfig, not {type(config).__name__}"
        )
    if config.save_fn is not None:
        raise ConfigError(
            "termination_config.save_fn is not used by GracefulInterruptCallback (Lightning "
            "saves resume.ckpt itself); leave it None"
        )
    return config


def _temp_prefix(final: Path) -> str:
    return f".tmp-{final.name}."


def _commit(trainer: pl.Trainer, final: Path) -> Path:
    """``trainer.save_checkpoint`` into a temporary beside ``final``, then fsync, rename and
    fsync the directory. Every rank calls it (the save is a collective under DDP); only global
    rank 0 writes a file, so only rank 0 syncs and renames."""
    tmp = final.with_name(f"{_temp_prefix(final)}{host_tag()}.{os.getpid()}.{os.urandom(4).hex()}")
    writer = trainer.is_global_zero
    try:
        trainer.save_checkpoint(tmp)
        if writer:
            fsync_path(tmp)
            os.replace(tmp, final)
            fsync_dir(final.parent)
    except BaseException:
        if writer:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise
    return final


def _clean_stale_temporaries(final: Path) -> None:
    """Remove temporaries of ``final`` left by a process of this host that was killed mid-save."""
    prefix, me = _temp_prefix(final), host_tag()
    with contextlib.suppress(OSError):
        for entry in final.parent.glob(prefix + "*"):
            host, _, rest = entry.name[len(prefix) :].partition(".")
            pid = rest.partition(".")[0]
            if host == me and pid.isdecimal() and not _pid_alive(int(pid)):
                with contextlib.suppress(OSError):
                    entry.unlink()


def _describe(handler: object) -> str:
    module = getattr(handler, "__module__", None) or "?"
    name = getattr(handler, "__qualname__", None) or type(handler).__name__
    return f"{module}.{name}"


def _is_users(handler: object) -> bool:
    """A handler someone installed (not SIG_DFL/SIG_IGN/None, not Python's Ctrl+C default)."""
    return callable(handler) and handler is not signal.default_int_handler


class GracefulInterruptCallback(pl.Callback):
    """Stop a fit cleanly on a signal or a platform notice, save ``save_dir/resume.ckpt``,
    resume exactly.

    Contract (kept from the published callback):

    - ``save_dir`` becomes a ``Path``; ``tracker=None`` skips upload and finalization.
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
    - after an interrupt the process exits with ``exit_code`` (default 0; None for 128 +
      signum, 143 for a platform notice) so no later callback's train-end hook runs.
    - ``teardown``: for "fit", in the creating process, the saved handlers are restored.

    ``termination_config``: how notices arrive (default: the detected platform's watchers and
    grace period, as for ``PreemptionCheckpointHandler``); its ``exit_fn`` replaces
    ``sys.exit``. A handler of one of ``signals`` installed before ``fit()`` is not called
    during the fit (a warning names it) and is back when the fit ends. Lightning's SLURM
    auto-requeue handler (SIGUSR1 by default) is then not installed: Lightning adds it only
    where no handler is set, and the callback takes its signals back in any case.

    Resume with ``trainer.fit(model, ckpt_path=callback.ckpt_path)``.
    """

    def __init__(
        self,
        save_dir: Path | str,
        tracker: Tracker | None = None,
        *,
        exit_code: int | None = 0,
        signals: list[int | str] | None = None,
        termination_config: TerminationConfig | None = None,
    ) -> None:
        super().__init__()
        self.save_dir = Path(save_dir)
        self.tracker = tracker
        self.exit_code = exit_code
        # None: the same set as PreemptionCheckpointHandler (INT, TERM, HUP, USR1, USR2)
        self.signals = normalize_signals(signals or None)
        self.termination_config = _choose_config(termination_config)
        self.trainer: pl.Trainer | None = None
        self._creator = os.getpid()
        self._ctl: StopController | None = None
        self._agreement: StopAgreement | None = None
        self._connector: Any = None  # Lightning's signal connector while its method is wrapped
        self._batches = 0
        self._saved_batches = -1  # the value of _batches at the last committed save
        self._batch_started = 0.0
        self._interrupted = False
        self._epoch_rng: dict[str, Any] | None = None
        self._validates = False  # this fit has a validation loop
        self._point: _Point | None = None  # the last training batch, while a validation runs
        self._saving: _Point | None = None
        self._pending_rng: dict[str, Any] | None = None
        self._resume_state: dict[str, Any] | None = None
        self._pending_at_epoch_start = False
        self._deferred = False  # the resume is aligned after on_run_start, not in on_train_start
        self._run_start: Any = None  # the fit loop while its on_run_start is wrapped

    @property
    def ckpt_path(self) -> Path:
        return self.save_dir / "resume.ckpt"

    @property
    def state_key(self) -> str:
        return "GracefulInterruptCallback"

    # -- contract hooks ------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.trainer = trainer
        if stage != "fit":
            return
        self._batches, self._saved_batches, self._interrupted = 0, -1, False
        self._point = self._saving = None
        self._pending_at_epoch_start = False
        self._defer_alignment(trainer)
        if self._ctl is not None:  # a new fit after a stop whose SystemExit was caught
            self._ctl.latch.restore()
        rank_zero = self._is_rank_zero(trainer)
        self._ctl = StopController(
            self.termination_config, self.signals, tracker=self.tracker if rank_zero else None
        )
        if os.getpid() != self._creator:
            return
        if rank_zero:
            _clean_stale_temporaries(self.ckpt_path)
        if self._ctl.start():
            self._warn_about_replaced_handlers()
            self._wrap_signal_registration(trainer)
        logger.info("Added GracefulInterrupt callback")

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_back_signals(trainer)
        state = self._resume_state
        if state is not None and state.get("fresh"):
            restore_rng(state["rng"])  # saved when a sanity check was stopped: start like it
            self._resume_state = None
        if trainer.world_size == 1:
            # the sanity check runs under Lightning's isolate_rng: the RNG after it is this one
            self._point = _Point(rng=capture_rng(), val_due=False, fresh=True)

    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._point = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_back_signals(trainer)
        self._validates = bool(trainer.enable_validation)  # Lightning's test costs ~10 us
        if not self._deferred:
            self._align_loaded_state(trainer)
        # DDP: every rank stops (and takes insurance checkpoints) after the same training
        # batch, through the same store agreement as PreemptionCheckpointHandler
        ranks = Ranks.detect()
        if ranks is not None:
            self._agreement = ranks.agreement()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The state the epoch's DataLoader iterator (seed, shuffle order) is drawn from. When
        # Lightning created that iterator before this hook (the first epoch of a fit), it is
        # created again here, from the state that is saved.
        self._epoch_rng = capture_rng()
        if not _lightning_iterates(trainer):
            _recreate_iterator(trainer)
            if self._pending_at_epoch_start:
                # the first epoch of a fit resumed after an epoch's end: Lightning then
                # fast-forwards its record of a validation, which draws for an iterator the
                # uninterrupted fit did not create; the next batch starts from this state
                self._pending_rng = capture_rng()
        self._pending_at_epoch_start = False

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._restore_pending_rng()
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
        ctl = self._ctl
        if ctl is None or ctl.stopped:
            return
        ctl.step_times.add(time.monotonic() - self._batch_started)
        if self._agreement is not None:
            self._at_ddp_boundary(trainer, self._agreement)
            return
        due = self._validates and _validation_due(trainer)
        if ctl.pending and self._at_boundary(trainer, _Point(rng=None, val_due=due)):
            return
        if due:  # a stop during that validation saves this batch's state
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
        ctl, point = self._ctl, self._point
        if ctl is None or trainer.state.fn != "fit":
            return
        # A validation batch counts as a step for the grace policy: after a training batch
        # with a validation due, the next boundary is one validation batch away.
        ctl.step_times.add(time.monotonic() - self._batch_started)
        # _point is only set inside a fit's validation (or sanity check), single process
        if point is not None and ctl.pending and not ctl.stopped:
            self._at_boundary(trainer, point)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._point = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The last place a stop can be seen: one that came after the last training batch
        # (final validation, epoch-end hooks) saves the finished state and exits.
        ctl = self._ctl
        if ctl is None or ctl.stopped:
            return
        if self._agreement is not None:
            self._agree_at_the_end(trainer, ctl, self._agreement)
        if ctl.requests.first_stop() is not None:
            ctl.latch.log_pending()
            self._stop(trainer, _Point(rng=None, val_due=False), saved=None)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        ours = isinstance(exception, SystemExit) and self._interrupted
        self._unwrap_run_start()
        self._close()
        if not ours and self._ctl is not None:
            self._ctl.tell_tracker("failed")  # rank 0 only: the others have no tracker

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._unwrap_run_start()
        if stage == "fit" and os.getpid() == self._creator:
            self._close()

    def state_dict(self) -> dict[str, Any]:
        point = self._saving or _Point(rng=None, val_due=False)
        return {
            "rng": point.rng if point.rng is not None else capture_rng(),
            "epoch_rng": None if point.fresh else self._epoch_rng,
            "interrupted": self._interrupted,
            "val_due": point.val_due,
            "fresh": point.fresh,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_state = dict(state_dict)

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

    # -- exact resume --------------------------------------------------------------------
    def _defer_alignment(self, trainer: pl.Trainer) -> None:
        """Align a resumed fit right after Lightning's ``_FitLoop.on_run_start``, i.e. after
        every callback's, the module's and the strategy's ``on_train_start``: what the
        alignment replays (a due validation, an epoch's end) ran after those hooks in the
        uninterrupted fit. Without the wrapper it happens in this callback's own hook."""
        self._unwrap_run_start()
        loop = trainer.fit_loop
        original = getattr(loop, "on_run_start", None)
        self._deferred = callable(original)
        if not self._deferred:
            return

        def on_run_start(*args: Any, **kwargs: Any) -> Any:
            self._unwrap_run_start()
            result = cast(Any, original)(*args, **kwargs)
            self._align_loaded_state(trainer)
            return result

        loop.on_run_start = on_run_start  # type: ignore[method-assign]
        self._run_start = loop

    def _unwrap_run_start(self) -> None:
        if self._run_start is not None:
            vars(self._run_start).pop("on_run_start", None)
            self._run_start = None

    def _align_loaded_state(self, trainer: pl.Trainer) -> None:
        state, self._resume_state = self._resume_state, None
        if state is not None and not state.get("fresh"):
            self._align_resume(trainer, state)

    def _align_resume(self, trainer: pl.Trainer, state: dict[str, Any]) -> None:
        """Put the RNG and the data position where an uninterrupted fit would have them.

        Saved at the end of batch k of an epoch: the resumed fit recreates the epoch's
        DataLoader iterator, which draws its seed (and, with shuffling, its order) from the
        global torch RNG. So the epoch-start state is restored first, the new iterator skips
        the k batches already trained on, and the batch-end state is restored just before
        the next batch (or a validation that was due) runs. Saved after an epoch's last
        batch: the batch-end state is restored at once, the validation that was due and the
        epoch's end run (``_end_the_saved_epoch``), and the next epoch's iterator is drawn
        when that epoch starts.

        Runs once every ``on_train_start`` hook has run (``_defer_alignment``), as the work
        it replays ran after them in the uninterrupted fit.
        """
        loop = trainer.fit_loop.epoch_loop
        done = cast(Any, loop.batch_progress.current).processed
        total = trainer.num_training_batches
        mid_epoch = 0 < done < total and state.get("epoch_rng") is not None
        if mid_epoch:
            restore_rng(state["epoch_rng"])
            self._epoch_rng = state["epoch_rng"]
            self._pending_rng = state.get("rng")
            _skip_first_batches(trainer, done)
            _recreate_iterator(trainer)
            if state.get("val_due"):
                self._restore_pending_rng()
                with _after_the_saved_batch(trainer):
                    self._run_due_validation(trainer)
                # Lightning then fast-forwards its own record of that validation, which
                # creates (and draws for) a validation iterator the uninterrupted fit did not
                self._pending_rng = capture_rng()
        elif state.get("rng") is not None and _ended_on_restore(trainer):
            # saved after an epoch's last batch: what the uninterrupted fit ran after it runs
            # now, then the next epoch starts with its on_train_epoch_start hooks, where this
            # callback draws the epoch's iterator (and the state after that draw is kept)
            restore_rng(state["rng"])
            self._end_the_saved_epoch(trainer, val_due=bool(state.get("val_due")))
            self._pending_at_epoch_start = True
        elif state.get("rng") is not None:
            # saved at an epoch's end, by a Lightning that starts the next epoch without
            # calling on_train_epoch_start, with an iterator it drew before this hook
            restore_rng(state["rng"])
            if state.get("val_due"):
                self._run_due_validation(trainer)
            self._epoch_rng = capture_rng()
            if not _lightning_iterates(trainer):
                _recreate_iterator(trainer)
            if state.get("val_due"):
                self._pending_rng = capture_rng()  # past the fast-forward's draw, as above

    def _end_the_saved_epoch(self, trainer: pl.Trainer, *, val_due: bool) -> None:
        """Run what the uninterrupted fit ran after the saved batch, the epoch's last
        (``_ended_on_restore``): the validation that was due, then Lightning's own end of an
        epoch (``_FitLoop.on_advance_end``: the ``on_train_epoch_end`` hooks, plateau
        schedulers, epoch metrics), with ``trainer.current_epoch`` that epoch. Then the next
        epoch starts as in the uninterrupted fit, ``on_train_epoch_start`` hooks included."""
        loop = trainer.fit_loop
        epoch_loop = cast(Any, loop.epoch_loop)
        # the restore counted the epoch processed and completed; on_advance_end counts it
        _shift(loop.epoch_progress, "processed", -1)
        _shift(loop.epoch_progress, "completed", -1)
        with _after_the_saved_batch(trainer):
            if val_due:
                self._run_due_validation(trainer)
            # counted after the validation in the uninterrupted fit, by the restart here
            epoch_loop._batches_that_stepped += 1
            restarting = loop._restarting
            loop._restarting = False  # a restarting loop skips the epoch's plateau schedulers
            try:
                loop.on_advance_end()
            finally:
                loop._restarting = restarting
                epoch_loop._batches_that_stepped -= 1
        # Lightning skips on_train_epoch_start (and the epoch's ready/started counts) for a
        # fit restarted mid-epoch; the saved epoch has ended, the next one starts afresh
        loop.reset_restart_stage()

    def _run_due_validation(self, trainer: pl.Trainer) -> None:
        """Run the validation the checkpoint marked due. A stop during it keeps that
        checkpoint, which records exactly this state, when it is ``resume.ckpt``."""
        resumed = trainer.ckpt_path
        single = trainer.world_size == 1
        if single and resumed is not None and Path(resumed).resolve() == self.ckpt_path.resolve():
            self._point = _Point(rng=None, val_due=True)
            self._saved_batches = self._batches
        _run_validation(trainer)
        self._point = None

    def _restore_pending_rng(self) -> None:
        if self._pending_rng is not None:
            restore_rng(self._pending_rng)
            self._pending_rng = None

    # -- stopping ------------------------------------------------------------------------
    def _at_boundary(self, trainer: pl.Trainer, point: _Point) -> bool:
        """Act on the requests at a boundary whose state is ``point``; True when stopped."""
        ctl = cast(StopController, self._ctl)
        saved_here = self._saved_batches == self._batches
        decision = ctl.decide(saved_here=saved_here)
        if decision is Decision.CONTINUE:
            return False
        saved = self.ckpt_path if saved_here else None
        if decision is Decision.INSURANCE:
            saved = self._insurance(trainer, point)
            if not ctl.must_stop_now():
                return False
        self._stop(trainer, point, saved)
        return True

    def _at_ddp_boundary(self, trainer: pl.Trainer, agreement: StopAgreement) -> None:
        """A training batch's end under DDP: the ranks agree on the batch at which they take
        an insurance checkpoint or stop (no collective while nothing is pending)."""
        ctl = cast(StopController, self._ctl)
        if not ctl.pending and agreement.quiet():
            return
        point = _Point(rng=None, val_due=self._validates and _validation_due(trainer))
        while True:
            local = ctl.decide(saved_here=self._saved_batches == self._batches)
            agreed = agreement.decide(local, ctl.requests.first_stop())
            if agreed.decision is Decision.CONTINUE:
                return
            if agreed.decision is Decision.INSURANCE:  # every rank saves at this batch
                self._insurance(trainer, point)
                continue  # the same batch: a stop may be due right after the save
            self._stop(trainer, point, None, agreed=agreed.notice)
            return

    @staticmethod
    def _agree_at_the_end(
        trainer: pl.Trainer, ctl: StopController, agreement: StopAgreement
    ) -> None:
        """Every rank is in ``on_train_end``: one collective per fit tells each whether any
        rank was told to stop, and by which signal (the largest, so all exit alike)."""
        first = ctl.requests.first_stop()
        if first is None:
            first = agreement.open_stop()  # a rank asked after this one passed its last batch
        mine = (first.signum or signal.SIGTERM) if first is not None else 0
        strategy = trainer.strategy
        value = torch.tensor(int(mine), device=strategy.root_device)
        agreed = int(strategy.reduce(value, reduce_op="max").item())
        if agreed and ctl.requests.first_stop() is None:
            _adopt(ctl, agreed)

    def _save(self, trainer: pl.Trainer, point: _Point) -> Path:
        started = time.monotonic()
        self._saving = point
        try:
            path = _commit(trainer, self.ckpt_path)
        finally:
            self._saving = None
        cast(StopController, self._ctl).save_times.add(time.monotonic() - started)
        self._saved_batches = self._batches
        return path

    def _insurance(self, trainer: pl.Trainer, point: _Point) -> Path | None:
        try:
            path = self._save(trainer, point)
        except Exception as exc:  # the final save may still work: keep training
            logger.error(
                "preemptible: insurance checkpoint %s failed: %s: %s",
                self.ckpt_path,
                type(exc).__name__,
                exc,
            )
            return None
        logger.warning(
            "preemptible: insurance checkpoint %s at global step %d; training goes on",
            path,
            trainer.global_step,
        )
        return path

    def _stop(
        self,
        trainer: pl.Trainer,
        point: _Point,
        saved: Path | None,
        *,
        agreed: Notice | None = None,
    ) -> None:
        """Save (unless ``saved``), tell the tracker, exit. ``agreed``: the stop every DDP
        rank agreed on (its signal gives every rank the same exit code)."""
        ctl = cast(StopController, self._ctl)
        first = agreed or ctl.requests.first_stop()
        logger.warning(
            "preemptible: %s: %s %s at global step %d, then stopping",
            first.source if first is not None else "stop",
            "saving" if saved is None else "already saved",
            self.ckpt_path,
            trainer.global_step,
        )
        self._interrupted = True
        rank_zero = self._is_rank_zero(trainer)
        quiet = rank_zero and self.tracker is not None
        notice, _ = ctl.finish(
            step=trainer.global_step,
            save=lambda: self._save(trainer, point),
            saved=saved,
            save_failed=self._save_failed,
            # Lightning finalizes its loggers with "failed" on the way out; for a logger on
            # the same run as the tracker that would be a second, wrong, final status
            after_tracker=(lambda: _quiet_loggers(trainer)) if quiet else None,
            record=rank_zero,
            notice=agreed,
        )
        code = self.exit_code if self.exit_code is not None else notice.exit_code
        logger.warning("preemptible: fit interrupted; exiting with %d", code)
        trainer.should_stop = True
        if self._agreement is not None:
            self._agreement.close()
            self._agreement = None
        self._keep_handlers_for_exit(trainer)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        ctl.hold_and_exit(code)  # an exit_fn that returns: the fit ends on should_stop

    def _save_failed(self, exc: Exception) -> Path:
        logger.error(
            "preemptible: saving %s failed: %s: %s", self.ckpt_path, type(exc).__name__, exc
        )
        return self.ckpt_path  # the contract: the upload is still attempted

    # -- signal handlers -----------------------------------------------------------------
    def _warn_about_replaced_handlers(self) -> None:
        latch = cast(StopController, self._ctl).latch
        for sig in latch.signals:
            previous = latch.previous(sig)
            if _is_users(previous) and not latch.handles(previous):
                name = signal_name(sig)
                logger.warning(
                    "preemptible: the %s handler installed before fit() (%s) is not called "
                    "during the fit: the callback handles %s (checkpoint, then exit); it is "
                    "put back when the fit ends",
                    name,
                    _describe(previous),
                    name,
                )

    def _wrap_signal_registration(self, trainer: pl.Trainer) -> None:
        """Lightning registers its SIGTERM handler at the start of the fit, after ``setup``
        and before the sanity check; take SIGTERM back the moment it does."""
        connector = getattr(trainer, "_signal_connector", None)
        register = getattr(connector, "register_signal_handlers", None)
        if connector is None or not callable(register):
            return  # on_sanity_check_start / on_train_start take it back instead

        def register_then_take_back() -> None:
            register()
            self._take_back_signals(trainer)

        connector.register_signal_handlers = register_then_take_back
        self._connector = connector

    def _take_back_signals(self, trainer: pl.Trainer) -> None:
        """Take our signals (SIGTERM, and the SLURM requeue signal where Lightning set a
        handler for it) back from Lightning, and make Lightning's later restore put back what
        the user had, not ours."""
        latch = self._ctl.latch if self._ctl is not None else None
        if latch is None or not latch.installed:
            return
        latch.reclaim()
        connector = getattr(trainer, "_signal_connector", None)
        originals = getattr(connector, "_original_handlers", None)
        if isinstance(originals, dict):
            for sig, handler in list(originals.items()):
                if latch.handles(handler):
                    originals[sig] = latch.previous(sig)
        if connector is not None and any(s == signal.SIGTERM for s, _ in latch.received):
            connector.received_sigterm = False  # it reached Lightning's handler too: ours

    def _keep_handlers_for_exit(self, trainer: pl.Trainer) -> None:
        """Lightning restores the handlers it found when the fit ends, also on the way out of
        a stop. Where that is SIG_DFL (a late signal would kill a process that has saved),
        ours stays, holding the exit code; any other handler is put back, so a notebook that
        catches the SystemExit gets its Ctrl+C back."""
        latch = cast(StopController, self._ctl).latch
        connector = getattr(trainer, "_signal_connector", None)
        originals = getattr(connector, "_original_handlers", None)
        if isinstance(originals, dict):
            for sig in latch.signals:
                if latch.previous(sig) in (signal.SIG_DFL, None):
                    originals.pop(sig, None)

    def _close(self) -> None:
        if self._agreement is not None:
            self._agreement.close()
            self._agreement = None
        if self._ctl is not None:
            self._ctl.close()  # a latch holding for the exit keeps its handlers to the end
        if self._connector is not None:
            vars(self._connector).pop("register_signal_handlers", None)
            self._connector = None

    @staticmethod
    def _is_rank_zero(trainer: pl.Trainer) -> bool:
        return int(getattr(trainer, "global_rank", 0)) == 0


def _adopt(ctl: StopController, signum: int | None) -> None:
    """Another rank was told to stop: stop as it does (same exit code, same tracker status)."""
    source = signal_name(signum) if signum else "notice"
    ctl.requests.add(Notice(source=source, signum=signum, detail="another rank was told"))


def _quiet_loggers(trainer: pl.Trainer) -> None:
    for lg in trainer.loggers:
        lg.finalize = _saver(getattr(lg, "save", None))  # type: ignore[method-assign]


__all__ = ["GracefulInterruptCallback"]
