"""The callback's signal handlers, in this process: restored however the fit ends."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from preemptible.lightning import GracefulInterruptCallback

pytestmark = pytest.mark.timeout(120)


def original(signum: int, frame: FrameType | None) -> None:
    raise AssertionError("the original handler ran")


@pytest.fixture(autouse=True)
def originals():
    old = {s: signal.signal(s, original) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in old.items():
        signal.signal(s, h)


def assert_restored() -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        assert signal.getsignal(s) is original, f"{signal.Signals(s).name} not restored"


class Model(pl.LightningModule):
    def __init__(self, fail_at: int | None = None, signal_at: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.fail_at, self.signal_at = fail_at, signal_at

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        if batch_idx == self.fail_at:
            raise RuntimeError("boom")
        if batch_idx == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(model: Model, save_dir: Path, **kw: object) -> GracefulInterruptCallback:
    callback = GracefulInterruptCallback(save_dir, **kw)  # type: ignore[arg-type]
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)
    trainer.fit(model, data)
    return callback


def test_restored_after_a_normal_fit(tmp_path: Path) -> None:
    callback = fit(Model(), tmp_path)
    assert isinstance(callback.save_dir, Path)
    assert not (tmp_path / "resume.ckpt").exists()
    assert_restored()


def test_restored_after_an_exception(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        fit(Model(fail_at=2), tmp_path)
    assert_restored()


def test_restored_after_an_interrupt(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        fit(Model(signal_at=3), str(tmp_path))  # type: ignore[arg-type]
    assert info.value.code == 0
    assert (tmp_path / "resume.ckpt").exists()
    assert_restored()  # Lightning's own restore after the fit must not bring ours back


def test_fit_in_a_thread_warns_instead_of_crashing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fit(Model(), tmp_path)
        except BaseException as exc:  # pragma: no cover - the failure being tested for
            errors.append(exc)

    with caplog.at_level(logging.WARNING, logger="preemptible"):
        t = threading.Thread(target=run)
        t.start()
        t.join(60)
    assert errors == []
    assert "off the main thread" in caplog.text
    assert_restored()


class FlakyTracker:
    """A test double of preemptible's own Tracker protocol (not of MLflow or W&B)."""

    def __init__(self, fail: str | None) -> None:
        self.fail, self.calls = fail, []  # type: ignore[var-annotated]

    def upload_checkpoint(self, path: Path) -> None:
        self.calls.append(("upload", Path(path).exists()))
        if self.fail == "upload":
            raise OSError("upload refused")

    def mark_preempting(self) -> None:
        self.calls.append(("preempting", None))

    def finalize(self, status: str) -> None:
        self.calls.append(("finalize", status))


def test_a_failed_upload_skips_finalization_and_is_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = FlakyTracker("upload")
    with caplog.at_level(logging.ERROR, logger="preemptible"), pytest.raises(SystemExit):
        fit(Model(signal_at=2), tmp_path, tracker=tracker)
    assert tracker.calls == [("upload", True)]
    assert "tracker upload failed: OSError: upload refused" in caplog.text
    assert_restored()


def test_a_failed_save_still_uploads_and_finalizes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # save_dir/resume.ckpt cannot be created under a file
    tracker = FlakyTracker(None)
    with caplog.at_level(logging.ERROR, logger="preemptible"), pytest.raises(SystemExit):
        fit(Model(signal_at=2), blocker, tracker=tracker)
    assert tracker.calls == [("upload", False), ("finalize", "preempted")]
    assert "saving" in caplog.text and "failed" in caplog.text
