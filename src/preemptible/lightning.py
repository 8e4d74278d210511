"""``GracefulInterruptCallback``: Lightning fits that stop cleanly and resume exactly.

The published contract is kept (see the class docstring); what is known to go wrong with the
callback as first shipped is fixed:

1. Nothing is saved inside the signal handler. The handler only records the signal (the
   latch); the checkpoint is written at the next training-batch boundary, and under DDP all
   ranks agree on the same batch through the process group's key-value store — a write when a
   signal arrives and a background poll, never a collective on every step.
2. No validation pass or epoch-end work runs after the stop: once ``resume.ckpt`` is committed
   the process exits from that batch boundary.
3. Forked DataLoader workers survive a process-group SIGTERM until the save is done.
4. Signal handlers are restored however the fit ends, including Lightning's own restore of the
   handlers it found (which were ours) after an interrupted fit.
5. The tracker is finalized once, with what happened ("preempted" for TERM/USR1/USR2, "killed"
   for Ctrl+C, "failed" for an exception), and the run record tells a supervisor the run was
   preempted even though the process exits 0.
6. RNG states travel in the callback's ``state_dict`` and are put back at the moment that keeps
   the resumed fit's draws aligned with an uninterrupted one.
7. ``exit_code`` chooses the code after an interrupt (default 0, the contract; ``None`` for
   128 + signum, what schedulers understand).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import torch

from . import _run
from ._signals import SignalLatch, normalize_signals, patch_dataloader_workers, signal_name
from ._state import capture_rng, restore_rng
from ._termination import StopRequests
from .trackers import Tracker

logger = logging.getLogger("preemptible")

_fits = 0  # one key namespace per fit, identical on every rank (they run the same fits)


class _StopAgreement:
    """All DDP ranks stop after the same batch, without a collective per batch.

    A rank that gets a signal writes ``pending`` to the store; a daemon thread on every rank
    polls for it. A rank that knows of the stop writes ``ack/<rank>`` = its batch count at its
    next boundary, once. When every ack is in, each rank computes the same stop batch
    ``max(acks) + accumulate + 1``; ranks run in lockstep (each optimizer step is a collective)
    so none can have passed it, and each stops when it gets there.
    """

    def __init__(self, store: Any, rank: int, world: int, prefix: str, accumulate: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.prefix, self.accumulate = prefix, accumulate
        self.pending = threading.Event()
        self.announced = self.acked = False
        self.stop_at: int | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="preemptible-ddp", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        key = self.prefix + "pending"
        while not self._done.wait(0.05):
            try:
                if self.store.check([key]):
                    self.pending.set()
                    return
            except Exception:  # the store went away: the fit is ending
                return

    def close(self) -> None:
        self._done.set()

    def should_stop(self, batches: int, requested_here: bool) -> bool:
        if requested_here and not self.announced:
            self.announced = True
            self.store.set(self.prefix + "pending", str(self.rank))
            self.pending.set()
        if not self.pending.is_set():
            return False
        if not self.acked:
            self.acked = True
            self.store.set(self.prefix + f"ack/{self.rank}", str(batches))
        if self.stop_at is None:
            keys = [self.prefix + f"ack/{r}" for r in range(self.world)]
            if self.store.check(keys):
                acks = [int(self.store.get(k)) for k in keys]
                self.stop_at = max(acks) + self.accumulate + 1
        return self.stop_at is not None and batches >= self.stop_at


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


def _recreate_iterator(trainer: pl.Trainer) -> None:
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        iter(fetcher)


class GracefulInterruptCallback(pl.Callback):
    """Stop a fit cleanly on SIGINT/SIGTERM, save ``save_dir/resume.ckpt``, resume exactly.

    Contract (kept from the published callback):

    - ``save_dir`` becomes a ``Path``; ``tracker=None`` skips upload and finalization.
    - ``setup``: stores the trainer for every stage; for "fit", in the process that created
      the callback, saves the current SIGINT and SIGTERM handlers, installs its own, and logs
      ``Added GracefulInterrupt callback`` at INFO.
    - first signal: a warning with the checkpoint path; ``resume.ckpt`` saved; with a tracker,
      the checkpoint is uploaded, then the run finalized. A failing step is logged, never
      raised; a failed save does not stop the upload; a failed upload skips the finalization.
      Then ``trainer.should_stop = True``.
    - second signal: a warning and ``os._exit(1)`` at once.
    - a signal in another process than the creator is ignored.
    - ``on_train_end``: nothing after a normal fit; after an interrupt, a warning and
      ``sys.exit(exit_code)`` so no later callback's train-end hook runs.
    - ``teardown``: for "fit", in the creating process, the saved handlers are restored.

    Resume with ``trainer.fit(model, ckpt_path=callback.ckpt_path)``.
    """

    def __init__(
        self,
        save_dir: Path | str,
        tracker: Tracker | None = None,
        *,
        exit_code: int | None = 0,
        signals: list[int | str] | None = None,
    ) -> None:
        super().__init__()
        self.save_dir = Path(save_dir)
        self.tracker = tracker
        self.exit_code = exit_code
        self.signals = normalize_signals(signals or [signal.SIGINT, signal.SIGTERM])
        self.trainer: pl.Trainer | None = None
        self._creator = os.getpid()
        self._requests = StopRequests()
        self._latch: SignalLatch | None = None
        self._agreement: _StopAgreement | None = None
        self._batches = 0
        self._interrupted = False
        self._epoch_rng: dict[str, Any] | None = None
        self._val_due = False
        self._pending_rng: dict[str, Any] | None = None
        self._resume_state: dict[str, Any] | None = None
        self._fit = 0

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
        global _fits
        _fits += 1
        self._fit = _fits  # counted in every process, so all ranks use the same store keys
        if os.getpid() != self._creator:
            return
        self._requests = StopRequests()
        self._interrupted = False
        self._batches = 0
        self._latch = SignalLatch(self.signals, self._requests.add)
        if self._latch.install():
            patch_dataloader_workers()
        logger.info("Added GracefulInterrupt callback")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_back_signals(trainer)
        if self._resume_state is not None:
            self._align_resume(trainer, self._resume_state)
            self._resume_state = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world = torch.distributed.get_world_size()
            if world > 1:
                from torch.distributed import distributed_c10d

                self._agreement = _StopAgreement(
                    distributed_c10d._get_default_store(),
                    torch.distributed.get_rank(),
                    world,
                    f"preemptible/fit{self._fit}/",
                    trainer.accumulate_grad_batches,
                )

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The state the epoch's DataLoader iterator (seed, shuffle order) is drawn from. When
        # Lightning created that iterator before this hook (the first epoch of a fit), it is
        # created again here, from the state that is saved.
        self._epoch_rng = capture_rng()
        if not _lightning_iterates(trainer):
            _recreate_iterator(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._restore_pending_rng()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._batches += 1
        requested = bool(self._requests.stopping)
        if requested and self._latch is not None:
            self._latch.log_pending()
        if self._agreement is not None:
            stop = self._agreement.should_stop(self._batches, requested)
        else:
            stop = requested
        if stop:
            self._stop(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._interrupted:
            self._exit()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        ours = isinstance(exception, SystemExit) and self._interrupted
        self._close()
        if not ours and self.tracker is not None and self._is_rank_zero(trainer):
            self._tracker_step("finalize", lambda t: t.finalize("failed"))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and os.getpid() == self._creator:
            self._close()

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": capture_rng(),
            "epoch_rng": self._epoch_rng,
            "interrupted": self._interrupted,
            "val_due": self._val_due,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_state = dict(state_dict)

    # -- exact resume --------------------------------------------------------------------
    def _align_resume(self, trainer: pl.Trainer, state: dict[str, Any]) -> None:
        """Put the RNG and the data position where an uninterrupted fit would have them.

        Saved at the end of batch k of an epoch: the resumed fit recreates the epoch's
        DataLoader iterator, which draws its seed (and, with shuffling, its order) from the
        global torch RNG. So the epoch-start state is restored first, the new iterator skips
        the k batches already trained on, and the batch-end state is restored just before
        the next batch (or a validation that was due) runs. Saved at an epoch's end: the
        batch-end state is restored at once, before the next epoch's iterator is drawn.
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
                _run_validation(trainer)
                # Lightning then fast-forwards its own record of that validation, which
                # creates (and draws for) a validation iterator the uninterrupted fit did not
                self._pending_rng = capture_rng()
        elif state.get("rng") is not None:
            # saved at an epoch's end: Lightning starts the next epoch without calling
            # on_train_epoch_start, with an iterator it drew before this hook
            restore_rng(state["rng"])
            self._epoch_rng = state["rng"]
            if not _lightning_iterates(trainer):
                _recreate_iterator(trainer)

    def _restore_pending_rng(self) -> None:
        if self._pending_rng is not None:
            restore_rng(self._pending_rng)
            self._pending_rng = None

    # -- internals -------------------------------------------------------------------------
    def _take_back_signals(self, trainer: pl.Trainer) -> None:
        """Lightning installs its SIGTERM handler after ``setup`` (chaining ours). Take SIGTERM
        back, and make Lightning's later restore put back what the user had, not ours."""
        latch = self._latch
        if latch is None or not latch.installed:
            return
        latch.reclaim()
        connector = getattr(trainer, "_signal_connector", None)
        originals = getattr(connector, "_original_handlers", None)
        if isinstance(originals, dict):
            for sig, handler in list(originals.items()):
                if latch.handles(handler):
                    originals[sig] = latch.previous(sig)

    def _close(self) -> None:
        if self._agreement is not None:
            self._agreement.close()
            self._agreement = None
        if self._latch is not None and not self._latch.holding:
            self._latch.restore()  # a latch holding for the exit keeps its handlers to the end

    @staticmethod
    def _is_rank_zero(trainer: pl.Trainer) -> bool:
        return int(getattr(trainer, "global_rank", 0)) == 0

    def _tracker_step(self, what: str, fn: Any) -> bool:
        try:
            fn(self.tracker)
        except Exception as exc:  # logged, never raised: the checkpoint matters more
            logger.error("preemptible: tracker %s failed: %s: %s", what, type(exc).__name__, exc)
            return False
        return True

    def _stop(self, trainer: pl.Trainer) -> None:
        notice = self._requests.first_stop()
        signum = notice.signum if notice is not None else signal.SIGTERM
        path = self.ckpt_path
        logger.warning(
            "preemptible: %s: saving %s at global step %d, then stopping",
            signal_name(signum or signal.SIGTERM),
            path,
            trainer.global_step,
        )
        self._interrupted = True
        # a validation due after this batch is skipped now (it would eat the notice window)
        # and run first thing on resume, so metrics and random draws stay as without a stop
        with contextlib.suppress(Exception):
            loop: Any = trainer.fit_loop.epoch_loop
            self._val_due = bool(loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
        rank_zero = self._is_rank_zero(trainer)
        if rank_zero:
            _run.update_record(
                state="stopping",
                preempting=True,
                reason=notice.source if notice else "signal",
                signum=signum,
                step=trainer.global_step,
            )
        try:
            trainer.save_checkpoint(path)  # a collective under DDP: every rank is here now
        except Exception as exc:
            logger.error("preemptible: saving %s failed: %s: %s", path, type(exc).__name__, exc)
        else:
            if rank_zero:
                _run.update_record(state="stopped", checkpoint=str(path.resolve()))
        if self.tracker is not None and rank_zero:
            status = "killed" if signum == signal.SIGINT else "preempted"
            if self._tracker_step("upload", lambda t: t.upload_checkpoint(path)):
                self._tracker_step("finalize", lambda t: t.finalize(status))
                # Lightning finalizes its loggers with "failed" on the way out; for a logger
                # on the same run that would be a second, wrong, final status
                for lg in trainer.loggers:
                    save = getattr(lg, "save", None)
                    lg.finalize = _saver(save)  # type: ignore[method-assign]
        trainer.should_stop = True
        self._exit(signum)

    def _exit(self, signum: int | None = None) -> None:
        code = self.exit_code if self.exit_code is not None else 128 + (signum or signal.SIGTERM)
        logger.warning("preemptible: fit interrupted; exiting with %d", code)
        if self._agreement is not None:
            self._agreement.close()
            self._agreement = None
        if self._latch is not None:
            # the checkpoint is saved: a late signal must not turn this exit into a death
            self._latch.hold_for_exit(code)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        sys.exit(code)


__all__ = ["GracefulInterruptCallback"]
