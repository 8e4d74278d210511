"""Canaries for the private torch and Lightning names preemptible relies on.

Each one fails loudly, naming what moved, when a torch or Lightning release renames or removes
it. The versions these were checked with are pinned in constraints.txt (torch 2.13.0,
lightning 2.6.6); a failure here means: read the new release's code, adapt the use in
src/preemptible, then update this file and the pin.
"""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import pytest
import torch


def test_torch_worker_signal_hook_exists() -> None:
    # _signals.patch_dataloader_workers wraps it to keep workers alive through a group SIGTERM
    from torch.utils.data._utils import signal_handling

    assert callable(getattr(signal_handling, "_set_worker_signal_handlers", None)), (
        "torch moved _set_worker_signal_handlers: DataLoader workers are no longer guarded"
    )


def test_torch_default_store_exists() -> None:
    # lightning.py's DDP stop agreement reads the process group's store through it
    from torch.distributed import distributed_c10d

    assert callable(getattr(distributed_c10d, "_get_default_store", None)), (
        "torch moved distributed_c10d._get_default_store: the DDP stop agreement has no store"
    )


@pytest.fixture(scope="module")
def trainer() -> pl.Trainer:
    return pl.Trainer(
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )


def test_lightning_signal_connector(trainer: pl.Trainer) -> None:
    # the callback takes SIGTERM back from Lightning and fixes Lightning's restore snapshot
    connector = getattr(trainer, "_signal_connector", None)
    assert connector is not None, "Lightning moved Trainer._signal_connector"
    assert callable(getattr(connector, "register_signal_handlers", None)), (
        "Lightning moved _SignalConnector.register_signal_handlers"
    )
    assert "_original_handlers" in vars(connector), (
        "Lightning moved _SignalConnector._original_handlers"
    )


def test_lightning_fit_loop_internals(trainer: pl.Trainer) -> None:
    # exact resume: skipping batches, recreating the epoch iterator, a validation that was due
    loop = trainer.fit_loop
    for name in ("_combined_loader", "_data_fetcher", "is_resuming"):
        assert hasattr(loop, name), f"Lightning moved _FitLoop.{name}"
    assert callable(loop.state_dict), "Lightning moved _FitLoop.state_dict"
    epoch_loop = loop.epoch_loop
    assert hasattr(epoch_loop, "restarting"), "Lightning moved _TrainingEpochLoop.restarting"
    check = getattr(epoch_loop, "_should_check_val_fx", None)
    assert callable(check), "Lightning moved _TrainingEpochLoop._should_check_val_fx"
    assert list(inspect.signature(check).parameters) == ["data_fetcher"], (
        "Lightning changed _should_check_val_fx's parameters"
    )
    assert hasattr(epoch_loop.val_loop, "restarting"), "Lightning moved the val loop's restarting"


def test_lightning_epoch_end_after_a_restore(trainer: pl.Trainer) -> None:
    # a fit resumed from a checkpoint taken after an epoch's last batch: Lightning's restore
    # counts the epoch as ended (_FitLoop.reset); the callback winds the counters back, runs
    # _FitLoop.on_advance_end (the epoch's end) after on_run_start, then resets the restart
    # stage so the next epoch starts with its hooks
    loop = trainer.fit_loop
    for name in ("on_run_start", "on_advance_end", "reset_restart_stage"):
        assert callable(getattr(loop, name, None)), f"Lightning moved _FitLoop.{name}"
    assert isinstance(vars(loop).get("_restarting"), bool), "Lightning moved _Loop._restarting"
    assert isinstance(loop.restarted_mid_epoch, bool), "Lightning moved restarted_mid_epoch"
    epoch_loop = loop.epoch_loop
    assert isinstance(epoch_loop.restarted_on_train_batch_end, bool), (
        "Lightning moved _TrainingEpochLoop.restarted_on_train_batch_end"
    )
    assert isinstance(vars(epoch_loop).get("_batches_that_stepped"), int), (
        "Lightning moved _TrainingEpochLoop._batches_that_stepped"
    )
    assert isinstance(epoch_loop.batch_progress.is_last_batch, bool), (
        "Lightning moved is_last_batch"
    )
    for progress in (loop.epoch_progress, epoch_loop.batch_progress):
        for record in (progress.total, progress.current):
            for field in ("processed", "completed"):
                assert isinstance(getattr(record, field, None), int), (
                    f"Lightning moved the progress trackers' {field}"
                )
    reset = inspect.getsource(type(loop).reset)
    assert "restarted_on_train_batch_end" in reset and "is_last_batch" in reset, (
        "Lightning changed how _FitLoop.reset counts an epoch restored after its last batch"
    )
    end = inspect.getsource(type(loop).on_advance_end)
    for piece in ("increment_processed", '"on_train_epoch_end"', "increment_completed"):
        assert piece in end, f"Lightning's _FitLoop.on_advance_end no longer has {piece}"
    start = inspect.getsource(type(loop).on_advance_start)
    assert "restarted_mid_epoch" in start and '"on_train_epoch_start"' in start, (
        "Lightning changed when _FitLoop.on_advance_start calls on_train_epoch_start"
    )


def test_lightning_combined_loader_and_sampler_epochs() -> None:
    # a mid-epoch resume: the callback replaces _FitLoop._combined_loader.flattened with
    # loaders that skip the batches already trained on, and sets the samplers' epoch to
    # epoch_progress.current.processed before the iterator is recreated, as Lightning does
    # at an epoch's start (a DistributedSampler permutes by epoch)
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    loader = torch.utils.data.DataLoader(list(range(4)))
    combined = CombinedLoader([loader], "max_size_cycle")
    assert combined.flattened == [loader], "Lightning changed CombinedLoader.flattened"
    other = torch.utils.data.DataLoader(list(range(2)))
    combined.flattened = [other]
    assert combined.flattened == [other], "CombinedLoader.flattened can no longer be set"
    start = inspect.getsource(_FitLoop.on_advance_start)
    assert "_combined_loader.flattened" in start, "Lightning moved _FitLoop._combined_loader"
    assert "_set_sampler_epoch(dl, self.epoch_progress.current.processed)" in start, (
        "Lightning changed which epoch it gives the samplers"
    )


def test_pinned_versions_are_the_ones_checked() -> None:
    import lightning

    assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
    assert lightning.__version__ == "2.6.6", lightning.__version__
