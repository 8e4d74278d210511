"""Exact resume of a Lightning fit: the RNG and the data position of an uninterrupted one.

Lightning saves no RNG state and resumes a mid-epoch checkpoint with a fresh DataLoader
iterator. The callback's ``state_dict`` carries the RNG states from the batch end and from the
epoch start; on resume the epoch's iterator is recreated from the epoch-start state, skips the
batches already trained on, and the batch-end state is put back just before the next batch.
Lightning resumes a checkpoint from an epoch's last batch as if that epoch had ended; what the
uninterrupted fit ran there (the validation, the epoch's end hooks, plateau schedulers, the
next epoch's start) is run through Lightning's own loop with the counters of that fit.

Lightning's loop internals used here are covered by ``tests/unit/test_private_api_canary.py``
(versions pinned).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import lightning.pytorch as pl

from ..frontend import capture_rng, restore_rng


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


def _set_sampler_epochs(trainer: pl.Trainer) -> None:
    """Tell the samplers the epoch an iterator is drawn for, as Lightning does at the start of
    every epoch (``DistributedSampler`` permutes by epoch): an iterator recreated before that
    (a mid-epoch resume) would otherwise replay epoch 0's order."""
    combined = trainer.fit_loop._combined_loader
    if combined is None:
        return
    epoch = cast(Any, trainer.fit_loop.epoch_progress.current).processed  # as Lightning does
    for loader in combined.flattened:
        for name in ("sampler", "batch_sampler"):
            set_epoch = getattr(getattr(loader, name, None), "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)


def _lightning_iterates(trainer: pl.Trainer) -> bool:
    """Whether Lightning will create the epoch's iterator itself after the current hook
    (its own condition in ``_TrainingEpochLoop.on_run_start``)."""
    loop = trainer.fit_loop
    return trainer.current_epoch > 0 and not loop.is_resuming and not loop.epoch_loop.restarting


def run_validation(trainer: pl.Trainer) -> None:
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


def validation_due(trainer: pl.Trainer) -> bool:
    """Whether Lightning runs a validation pass after the current training batch (its own
    test, in ``_TrainingEpochLoop.on_advance_end``)."""
    try:
        loop: Any = trainer.fit_loop.epoch_loop
        return bool(loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
    except Exception:  # a Lightning without it: a validation due is then not rerun on resume
        return False


class ExactResume:
    """The RNG and data-position alignment of one callback across fits.

    ``run_due_validation(trainer)``: the callback's way of running a validation that the
    checkpoint marked due (it knows whether a stop during it may keep that checkpoint).
    """

    def __init__(self, run_due_validation: Callable[[pl.Trainer], None]) -> None:
        self.run_due_validation = run_due_validation
        self.epoch_rng: dict[str, Any] | None = None
        self._pending_rng: dict[str, Any] | None = None
        self._resume_state: dict[str, Any] | None = None
        self._pending_at_epoch_start = False
        self._deferred = False  # aligned after on_run_start, not in on_train_start
        self._run_start: Any = None  # the fit loop while its on_run_start is wrapped
        self.replayed = 0  # work of the saved fit run again on resume (a validation, an epoch end)

    def load(self, state: dict[str, Any]) -> None:
        self._resume_state = dict(state)

    def setup(self, trainer: pl.Trainer) -> None:
        self._pending_at_epoch_start = False
        self.replayed = 0
        self.defer(trainer)

    def sanity_check_start(self) -> None:
        state = self._resume_state
        if state is not None and state.get("fresh"):
            restore_rng(state["rng"])  # saved when a sanity check was stopped: start like it
            self._resume_state = None

    def train_start(self, trainer: pl.Trainer) -> None:
        if not self._deferred:
            self.align_loaded(trainer)

    def epoch_start(self, trainer: pl.Trainer) -> None:
        # The state the epoch's DataLoader iterator (seed, shuffle order) is drawn from. When
        # Lightning created that iterator before this hook (the first epoch of a fit), it is
        # created again here, from the state that is saved.
        self.epoch_rng = capture_rng()
        if not _lightning_iterates(trainer):
            _recreate_iterator(trainer)
            if self._pending_at_epoch_start:
                # the first epoch of a fit resumed after an epoch's end: Lightning then
                # fast-forwards its record of a validation, which draws for an iterator the
                # uninterrupted fit did not create; the next batch starts from this state
                self._pending_rng = capture_rng()
        self._pending_at_epoch_start = False

    def defer(self, trainer: pl.Trainer) -> None:
        """Align a resumed fit right after Lightning's ``_FitLoop.on_run_start``, i.e. after
        every callback's, the module's and the strategy's ``on_train_start``: what the
        alignment replays (a due validation, an epoch's end) ran after those hooks in the
        uninterrupted fit. Without the wrapper it happens in this callback's own hook."""
        self.unwrap()
        loop = trainer.fit_loop
        original = getattr(loop, "on_run_start", None)
        self._deferred = callable(original)
        if not self._deferred:
            return

        def on_run_start(*args: Any, **kwargs: Any) -> Any:
            self.unwrap()
            result = cast(Any, original)(*args, **kwargs)
            self.align_loaded(trainer)
            return result

        loop.on_run_start = on_run_start  # type: ignore[method-assign]
        self._run_start = loop

    def unwrap(self) -> None:
        if self._run_start is not None:
            vars(self._run_start).pop("on_run_start", None)
            self._run_start = None

    def align_loaded(self, trainer: pl.Trainer) -> None:
        state, self._resume_state = self._resume_state, None
        # a sanity check's checkpoint starts the fit afresh; a finished fit's has nothing to
        # align (Lightning trains nothing from it)
        if state is not None and not state.get("fresh") and not state.get("finished"):
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
            self.epoch_rng = state["epoch_rng"]
            self._pending_rng = state.get("rng")
            _set_sampler_epochs(trainer)
            _skip_first_batches(trainer, done)
            _recreate_iterator(trainer)
            if state.get("val_due"):
                self.restore_pending_rng()
                with _after_the_saved_batch(trainer):
                    self.run_due_validation(trainer)
                self.replayed += 1
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
            self.replayed += 1
        elif state.get("rng") is not None:
            # saved at an epoch's end, by a Lightning that starts the next epoch without
            # calling on_train_epoch_start, with an iterator it drew before this hook
            restore_rng(state["rng"])
            if state.get("val_due"):
                self.run_due_validation(trainer)
                self.replayed += 1
            self.epoch_rng = capture_rng()
            if not _lightning_iterates(trainer):
                _set_sampler_epochs(trainer)
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
                self.run_due_validation(trainer)
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

    def restore_pending_rng(self) -> None:
        if self._pending_rng is not None:
            restore_rng(self._pending_rng)
            self._pending_rng = None
