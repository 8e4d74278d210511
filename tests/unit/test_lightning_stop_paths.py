"""The callback's stop paths in this process: SIGTERM taken from Lightning, a user's handler,
the atomic ``resume.ckpt``, stale temporaries, the DDP agreement's store format, bad input."""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from preemptible import Notice, TerminationConfig
from preemptible._errors import ConfigError
from preemptible._files import host_tag
from preemptible.distributed._agreement import StopAgreement
from preemptible.lightning import GracefulInterruptCallback
from preemptible.stop._controller import Decision
from preemptible.stop._latch import DEFAULT_SIGNALS
from tests.support.signals import SignalHandlers

pytestmark = pytest.mark.timeout(120)


def users_handler(signum: int, frame: FrameType | None) -> None:
    raise AssertionError("the handler installed before fit() ran during the fit")


@pytest.fixture(autouse=True)
def handlers_before_fit(signal_handlers: SignalHandlers) -> None:
    # every signal the callback handles by default: a stopped fit keeps its handler (holding
    # the exit code) where the one before was SIG_DFL, which must not reach the next test
    signal_handlers.keep(*DEFAULT_SIGNALS)
    signal_handlers.install(users_handler, signal.SIGINT, signal.SIGTERM)


class Model(pl.LightningModule):
    def __init__(self, signal_at: int | None = None, signal_in_sanity: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.signal_at, self.signal_in_sanity = signal_at, signal_in_sanity

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        if batch_idx == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.trainer.sanity_checking and self.signal_in_sanity and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


class FailingWrite(TorchCheckpointIO):
    """Writes half of the checkpoint where it is told to, then fails (a full disk)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):  # type: ignore[no-untyped-def]
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        with open(path, "wb") as fh:
            fh.write(buffer.getvalue()[:100])
        raise OSError(28, "No space left on device")


def loader() -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)


def fit(
    model: Model,
    callback: GracefulInterruptCallback,
    *,
    sanity: int = 0,
    val: bool = False,
    **kw: Any,
) -> pl.Trainer:
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=sanity,
        callbacks=[callback],
        **kw,
    )
    trainer.fit(model, loader(), loader() if sanity or val else None)
    return trainer


def returning(codes: list[int]) -> TerminationConfig:
    """An exit_fn that records the code and returns: the fit then ends on should_stop."""
    return TerminationConfig(exit_fn=codes.append)


def test_sigterm_in_the_sanity_check_is_ours_not_lightnings(tmp_path: Path) -> None:
    codes: list[int] = []
    callback = GracefulInterruptCallback(tmp_path, termination_config=returning(codes))
    trainer = fit(Model(signal_in_sanity=True), callback, sanity=2)
    assert codes == [143]
    assert trainer.received_sigterm is False  # Lightning never saw it
    assert trainer.global_step == 0  # nothing trained after the stop
    saved = torch.load(tmp_path / "resume.ckpt", weights_only=False)
    assert saved["callbacks"]["GracefulInterruptCallback"]["fresh"] is True
    assert "loops" not in saved  # the resumed fit starts like a new one, sanity check included
    assert signal.getsignal(signal.SIGTERM) is users_handler


def test_a_handler_installed_before_fit_is_named_not_called_and_restored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="preemptible"), pytest.raises(SystemExit) as e:
        fit(Model(signal_at=2), GracefulInterruptCallback(tmp_path))
    assert e.value.code == 143
    name = f"{__name__}.users_handler"
    assert f"the SIGTERM handler installed before fit() ({name}) is not called" in caplog.text
    assert f"the SIGINT handler installed before fit() ({name})" in caplog.text
    assert (tmp_path / "resume.ckpt").exists()
    for s in (signal.SIGINT, signal.SIGTERM):
        assert signal.getsignal(s) is users_handler  # back as soon as fit() is left


def test_after_a_stop_sigterm_stays_held_and_the_next_fit_starts_clean(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    callback = GracefulInterruptCallback(tmp_path)
    with pytest.raises(SystemExit):  # caught, as a notebook does
        fit(Model(signal_at=2), callback)
    # SIG_DFL would let a late SIGTERM kill a process that has saved: ours holds the code
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, users_handler)
    assert signal.getsignal(signal.SIGINT) is users_handler
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        fit(Model(), callback)  # the same callback, a new fit: the hold ends
    assert "SignalLatch" not in caplog.text
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_failed_write_keeps_the_previous_resume_ckpt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    codes: list[int] = []
    fit(
        Model(signal_at=2), GracefulInterruptCallback(tmp_path, termination_config=returning(codes))
    )
    ckpt = tmp_path / "resume.ckpt"
    committed = ckpt.read_bytes()
    callback = GracefulInterruptCallback(tmp_path, termination_config=returning(codes))
    with caplog.at_level(logging.ERROR, logger="preemptible"):
        fit(Model(signal_at=5), callback, plugins=[FailingWrite()])
    assert codes == [143, 143]
    assert "No space left on device" in caplog.text
    assert ckpt.read_bytes() == committed
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".preemptible.lock", "resume.ckpt"]  # no temporary left


def test_temporaries_of_dead_writers_on_this_host_are_removed(tmp_path: Path) -> None:
    done = subprocess.Popen(["true"])
    done.wait()
    prefix = ".tmp-resume.ckpt."
    dead = tmp_path / f"{prefix}{host_tag()}.{done.pid}.0a0b0c0d"
    alive = tmp_path / f"{prefix}{host_tag()}.{os.getpid()}.0a0b0c0d"
    foreign = tmp_path / f"{prefix}some-other-host.{done.pid}.0a0b0c0d"
    for p in (dead, alive, foreign):
        p.write_bytes(b"torn")
    fit(Model(), GracefulInterruptCallback(tmp_path))
    assert not dead.exists()
    assert alive.exists() and foreign.exists()  # still being written, or not ours to judge


def test_a_stop_asked_for_after_another_rank_passed_its_last_batch_is_seen_at_the_end() -> None:
    """The DDP path's end of fit: rank 0 has passed its last boundary when rank 1 asks for a
    stop; the agreement would act at a boundary that never comes, so ``on_train_end`` asks
    ``open_stop()``, which must return the stop with rank 1's signal."""
    store = torch.distributed.HashStore()
    told = StopAgreement(store, 1, 2, poll_interval=0.01, timeout=10)
    other = StopAgreement(store, 0, 2, poll_interval=0.01, timeout=10)
    try:
        assert other.open_stop() is None
        assert other.quiet()  # rank 0's last batch
        notice = Notice(source="SIGINT", signum=signal.SIGINT)
        assert told.decide(Decision.STOP, notice).decision is Decision.CONTINUE
        seen = other.open_stop()
        assert seen is not None and seen.signum == signal.SIGINT
    finally:
        told.close()
        other.close()


class SlowValidation(Model):
    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        time.sleep(0.2)
        return super().validation_step(batch, batch_idx)


def test_validation_batches_count_as_steps_for_the_grace_policy(tmp_path: Path) -> None:
    # After a training batch with a validation due, the next boundary is a validation batch
    # away: the policy must budget for one, or the final save can miss the deadline.
    callback = GracefulInterruptCallback(tmp_path)
    fit(SlowValidation(), callback, val=True, limit_val_batches=2)
    assert callback._session is not None and callback._session.step_times.max() >= 0.2


def test_bad_termination_config_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must be a TerminationConfig, not str"):
        GracefulInterruptCallback(tmp_path, termination_config="gce")  # type: ignore[arg-type]
    config = TerminationConfig(save_fn=lambda path: None)
    with pytest.raises(ConfigError, match="save_fn is not used by GracefulInterruptCallback"):
        GracefulInterruptCallback(tmp_path, termination_config=config)
