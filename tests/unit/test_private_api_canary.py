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


def test_pinned_versions_are_the_ones_checked() -> None:
    import lightning

    assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
    assert lightning.__version__ == "2.6.6", lightning.__version__
