"""``PreemptibleLoop``: the accelerate front end of the kit, for a training loop of one's own.

accelerate users keep their loop and accelerate's own checkpoints: a checkpoint is what
``accelerator.save_state(dir)`` writes (the models, optimizers, schedulers, scaler, every
process's random states, the objects given to ``register_for_checkpointing``), and a resume is
``accelerator.load_state(dir)`` plus the position in the data. What the front end adds:

- where the boundaries are: ``batches(loader)`` yields the epoch's batches, and the moment the
  loop asks for the next one is the step's boundary (after the optimizer step; with gradient
  accumulation only where ``accelerator.sync_gradients`` says the step is complete);
  ``epochs(n)`` yields the epochs from the resumed one, and the end of each is a boundary too;
- the save: ``accelerator.save_state`` into a temporary of the store, committed as
  ``checkpoint-N`` (N: batches trained) through the kit's ``StagedSaver``, as the Trainer's
  ``checkpoint-N``: under torch.distributed rank 0 makes the temporary, every process writes
  its part (accelerate's ``random_states_{i}.pkl`` among them) and rank 0 commits once all
  have. A stop happens at the same step on every process through the kit's agreement, with no
  collective per step (accelerate's ``check_trigger`` is one per call);
- the data position, in a small file of each process beside accelerate's (the epoch, the
  batches of it trained, and the random states as the epoch's iterator was made). Making a
  DataLoader's iterator draws from torch's random state (its base seed, and the shuffle's seed
  when the sampler has no generator), and accelerate's sampler generator is not in
  ``save_state``: a resume that made its iterator after ``load_state`` would shuffle and drop
  out differently. So the resumed epoch's iterator (``accelerator.skip_first_batches``) is made
  from the random states of that epoch's start, and then the states ``load_state`` put back
  are put back again: the run goes on bit for bit as if never stopped.

Randomness inside the dataset's items (augmentation drawn per item) is not replayed by a skip:
make it a function of the index, as an uninterrupted run's order is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..frontend import (
    CheckpointLoadError,
    CheckpointSaveError,
    ConfigError,
    EpochLoop,
    Periodic,
    StagedSaver,
    TerminationConfig,
    capture_rng,
    checkpoint_directory,
    restore_rng,
    saving_config,
    without_crc32,
)

logger = logging.getLogger("preemptible")

NAME = "checkpoint-{step}"
POSITION = "preemptible_position_{rank}.pt"  # beside accelerate's random_states_{rank}.pkl
_DONE = object()


class _SaveStateSaver(StagedSaver):
    """``accelerator.save_state`` into a temporary of the store, committed as ``checkpoint-N``;
    a resume is ``accelerator.load_state`` of the newest one that loads."""

    def __init__(self, directory: Path | str, accelerator: Any, *, keep: int) -> None:
        super().__init__(directory, NAME, keep=keep)
        self.accelerator = accelerator
        self.position: dict[str, Any] | None = None  # the resumed checkpoint's

    def write(self, step: int, context: Any) -> Path:
        parent = self.stage(step)  # the same temporary on every process
        rank = self.accelerator.process_index
        target = parent / self.name(step)
        try:
            with without_crc32():  # the optimizer's torch.save, as a payload is written
                self.accelerator.save_state(str(target))
                torch.save(context, target / POSITION.format(rank=rank))
        except Exception as exc:
            self._tell_rank_zero(exc)
            raise CheckpointSaveError(
                f"accelerator.save_state of step {step} failed: {type(exc).__name__}: {exc}",
                self.target(step),
            ) from exc
        return super().write(step, context)

    def _tell_rank_zero(self, exc: Exception) -> None:
        """A process other than rank 0 failed its part: rank 0, which waits for every part
        before it commits, fails the save at once instead of at its timeout."""
        ranks, key = self.ranks, self._key
        if ranks is not None and key is not None and not ranks.is_zero:
            ranks.announce(f"{key}/written/{ranks.rank}", {"error": f"{type(exc).__name__}: {exc}"})

    def resume(self, hint: Path | None) -> tuple[int, Path] | None:
        found = self.store.load_newest(self._load, pattern=self.pattern)
        if found is None:
            return None
        ckpt, step = found
        self.last = (step, ckpt.path)
        return self.last

    def _load(self, path: Path) -> int:
        rank = self.accelerator.process_index
        where = path / POSITION.format(rank=rank)
        if not where.is_file():
            raise CheckpointLoadError(
                f"{path} has no {where.name}: it was not saved by PreemptibleLoop (or by "
                "another number of processes)",
                path,
            )
        position = torch.load(where, map_location="cpu", weights_only=True)
        self.accelerator.load_state(str(path))
        self.position = position
        return int(position["step"])


class PreemptibleLoop(EpochLoop):
    """Stop a training loop on ``accelerate.Accelerator`` cleanly on a signal or a platform
    notice, as a committed ``checkpoint-N`` (``accelerator.save_state``), and resume it bit for
    bit (``accelerator.load_state`` and the position in the data)::

        model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(...)
        loop = PreemptibleLoop(accelerator, "ckpt")
        for epoch in loop.epochs(num_epochs):
            for batch in loop.batches(train_dataloader):
                ...  # forward, accelerator.backward, optimizer.step, scheduler.step

    Create it after ``accelerator.prepare`` (and ``register_for_checkpointing``): it resumes
    at once from the newest committed ``checkpoint-N`` in ``checkpoint_dir`` (None: the
    supervisor's ``PREEMPTIBLE_CHECKPOINT_DIR``; a bucket's URL: committed in the machine's
    staging directory and uploaded, the newest brought back on a new machine; the processes
    of one machine share it). ``epochs`` starts at the resumed epoch,
    ``batches`` at the resumed batch (``accelerator.skip_first_batches``). On the first signal
    of ``signals`` or a notice, every process finishes its step, the checkpoint is committed
    and the processes exit 128 + signum (143 for a notice; ``exit_code``: a fixed code).
    ``save_every_steps``/``save_every_seconds``: periodic checkpoints (insurance against a
    SIGKILL); ``keep``: how many ``checkpoint-N`` are kept. When ``epochs`` ends, the last step
    is committed, so that running the command again trains nothing.

    ``step``: batches trained so far; ``epoch``, ``batch``: the epoch under way and the
    batches of it trained. One ``batches`` per epoch, each loader once per epoch.
    """

    def __init__(
        self,
        accelerator: Any,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        *,
        keep: int = 2,
        save_every_steps: int | str | None = None,
        save_every_seconds: float | None = None,
        termination_config: TerminationConfig | None = None,
        signals: Iterable[int | str] | None = None,
        tracker: Any | None = None,
        exit_code: int | None = None,
    ) -> None:
        if not all(hasattr(accelerator, a) for a in ("save_state", "load_state", "process_index")):
            raise ConfigError(
                f"accelerator={type(accelerator).__name__} is not valid; pass the "
                "accelerate.Accelerator the loop's objects were prepared with"
            )
        config = saving_config(termination_config, "PreemptibleLoop (accelerator.save_state)")
        periodic = Periodic.of(save_every_steps, save_every_seconds)
        self.accelerator = accelerator
        saver = _SaveStateSaver(checkpoint_directory(checkpoint_dir), accelerator, keep=keep)
        super().__init__(  # resumes through accelerator.load_state
            saver,
            termination_config=config,
            signals=signals,
            tracker=tracker,
            periodic=periodic,
            exit_code=exit_code,
        )
        if self.resume_path is not None and hasattr(accelerator, "register_load_state_pre_hook"):
            accelerator.register_load_state_pre_hook(self._loaded_after_resume)

    def _loaded_after_resume(self, models: Any, input_dir: str) -> None:
        """A ``load_state`` of the script's own after the loop resumed (accelerate's example
        keeps its ``--resume_from_checkpoint``): it puts another checkpoint's weights back at
        the loop's position, and the run would end unlike one never stopped, each line saying
        it resumed. Said where it happens."""
        logger.warning(
            "preemptible: accelerator.load_state(%r) after PreemptibleLoop resumed from %s at "
            "step %d: the weights are now that folder's, the data position still step %d's; "
            "leave the script's own resume off (the loop resumes by itself)",
            input_dir,
            self.resume_path,
            self.step,
            self.step,
        )

    def batches(self, dataloader: Any) -> Iterator[Any]:
        """The batches of ``dataloader`` (prepared by the accelerator) for this epoch, from
        the resumed batch; asking for the next one is the step's boundary."""
        return self._batches(dataloader)

    def _batches(self, loader: Any) -> Iterator[Any]:
        session, accelerator = self.session, self.accelerator
        skip = self.batch
        if hasattr(loader, "iteration") and loader.iteration != self.epoch:
            loader.set_epoch(self.epoch)  # accelerate's count of the loader's passes (its seed)
        generator = getattr(loader, "synchronized_generator", None)
        # a stateful loader (use_stateful_dataloader) is put back by load_state itself
        stateful = bool(getattr(loader, "use_stateful_dataloader", False))
        resumed = skip > 0 and self._epoch_rng is not None and not stateful
        if resumed:
            # the iterator is made from the random states of the epoch's start, as it was
            epoch_rng = self._epoch_rng
            assert epoch_rng is not None
            after_load = capture_rng()
            torch.set_rng_state(epoch_rng["torch"])
            if generator is not None and epoch_rng.get("generator") is not None:
                generator.set_state(epoch_rng["generator"])
            source = accelerator.skip_first_batches(loader, skip)
        else:
            self._epoch_rng = {
                "torch": torch.get_rng_state(),
                "generator": generator.get_state() if generator is not None else None,
            }
            source = loader
        batches = iter(source)
        batch = next(batches, _DONE)
        if resumed:
            restore_rng(after_load)  # the step's own random states, as load_state left them
        while batch is not _DONE:
            yield batch
            self.batch += 1
            self.step += 1
            if accelerator.sync_gradients and session.at_boundary(
                step=self.step, context=self._position()
            ):
                return
            batch = next(batches, _DONE)
