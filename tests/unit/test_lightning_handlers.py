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
from preemptible.stop._latch import DEFAULT_SIGNALS
from tests.conftest import wait_for
from tests.support.signals import SignalHandlers

pytestmark = pytest.mark.timeout(120)


def original(signum: int, frame: FrameType | None) -> None:
    raise AssertionError("the original handler ran")


@pytest.fixture(autouse=True)
def originals(signal_handlers: SignalHandlers) -> None:
    # every signal the callback handles by default: a stopped fit keeps its handler (holding
    # the exit code) where the one before was SIG_DFL, which must not reach the next test
    signal_handlers.keep(*DEFAULT_SIGNALS)
    signal_handlers.install(original, signal.SIGINT, signal.SIGTERM)


def assert_restored(expected: object = original) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        assert signal.getsignal(s) is expected, f"{signal.Signals(s).name} not restored"


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


def fit(
    model: Model,
    save_dir: Path,
    callback: GracefulInterruptCallback | None = None,
    **kw: object,
) -> GracefulInterruptCallback:
    if callback is None:
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
    assert info.value.code == 143  # 128 + SIGTERM, the default since the kit
    assert (tmp_path / "resume.ckpt").exists()
    assert_restored()  # Lightning's own restore after the fit must not bring ours back


def test_fit_in_a_thread_installs_nothing_and_the_next_main_thread_fit_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Off the main thread the callback cannot install handlers: it warns, a signal during that
    fit goes to the program's own handler (not to a stale or half-installed one of ours), and
    the same callback still installs, stops, saves and restores in a main-thread fit after."""
    received: list[int] = []

    def mine(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    signal.signal(signal.SIGTERM, mine)
    signal.signal(signal.SIGINT, mine)
    callback = GracefulInterruptCallback(tmp_path)
    errors: list[BaseException] = []
    seen_in_fit: list[object] = []

    class Probe(Model):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            if batch_idx == 2:
                seen_in_fit.extend(signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM))
                os.kill(os.getpid(), signal.SIGTERM)  # handled in the main thread, by `mine`
            return super().training_step(batch, batch_idx)

    def run() -> None:
        try:
            fit(Probe(), tmp_path, callback)
        except BaseException as exc:  # pragma: no cover - the failure being tested for
            errors.append(exc)

    with caplog.at_level(logging.WARNING, logger="preemptible"):
        t = threading.Thread(target=run)
        t.start()
        t.join(60)
    assert not t.is_alive()
    assert errors == []
    assert "off the main thread" in caplog.text
    assert seen_in_fit == [mine, mine], "the callback installed something off the main thread"
    wait_for(lambda: received, 10, "the program's own SIGTERM handler to run")
    assert received == [signal.SIGTERM]
    assert not (tmp_path / "resume.ckpt").exists(), "the off-thread fit stopped on the signal"
    assert_restored(mine)

    # the same callback, now in the main thread: installs, stops on SIGTERM, saves, restores
    with pytest.raises(SystemExit) as info:
        fit(Model(signal_at=3), tmp_path, callback)
    assert info.value.code == 143
    assert (tmp_path / "resume.ckpt").exists()
    assert received == [signal.SIGTERM], "the main-thread fit's signal reached the old handler"
    assert_restored(mine)


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


class Unsaveable(Model):
    def on_save_checkpoint(self, checkpoint):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")


def test_a_failed_save_still_uploads_and_finalizes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = FlakyTracker(None)
    with caplog.at_level(logging.ERROR, logger="preemptible"), pytest.raises(SystemExit):
        fit(Unsaveable(signal_at=2), tmp_path, tracker=tracker)
    assert tracker.calls == [("upload", False), ("finalize", "preempted")]
    assert "saving" in caplog.text and "No space left on device" in caplog.text
    assert not (tmp_path / "resume.ckpt").exists()


def test_a_save_dir_that_cannot_be_made_fails_the_fit_before_it_trains(tmp_path: Path) -> None:
    from preemptible import CheckpointSaveError

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # save_dir/resume.ckpt cannot be created under a file
    trained: list[int] = []

    class Counting(Model):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            trained.append(batch_idx)
            return super().training_step(batch, batch_idx)

    with pytest.raises(CheckpointSaveError, match="not-a-dir is a file, not a directory"):
        fit(Counting(), blocker)
    assert trained == []
    assert_restored()


def test_default_signals_include_slurms_usr1_over_lightnings_auto_requeue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under SLURM with Lightning's auto-requeue (its SIGUSR1 handler saves inside the handler
    and calls ``scontrol requeue``), every default signal is the callback's during the fit: a
    USR1 from ``sbatch --signal=B:USR1@...`` saves ``resume.ckpt`` at the batch boundary and
    exits 128 + 10, and Lightning's handler never runs (no ``hpc_ckpt_*.ckpt``)."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from preemptible import TerminationConfig

    for name, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "fit", "SLURM_JOB_ID": "7"}.items():
        monkeypatch.setenv(name, value)
    seen: dict[int, object] = {}

    class Probe(Model):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            if batch_idx == 2:
                seen.update({s: signal.getsignal(s) for s in DEFAULT_SIGNALS})
                os.kill(os.getpid(), signal.SIGUSR1)
            return super().training_step(batch, batch_idx)

    # no platform watcher: only the signal is under test (and no scontrol is called)
    callback = GracefulInterruptCallback(
        tmp_path / "ckpt", exit_code=None, termination_config=TerminationConfig()
    )
    assert set(callback.signals) == set(DEFAULT_SIGNALS)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[callback],
        plugins=[SLURMEnvironment(auto_requeue=True)],
    )
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)
    with pytest.raises(SystemExit) as info:
        trainer.fit(Probe(), data)
    assert info.value.code == 128 + signal.SIGUSR1
    assert trainer.global_step == 3  # the batch the signal arrived in finished, no other
    assert (tmp_path / "ckpt" / "resume.ckpt").exists()
    assert list(tmp_path.rglob("hpc_ckpt_*")) == []
    latch = callback._session.latch  # type: ignore[union-attr]
    assert sorted(seen) == sorted(DEFAULT_SIGNALS)
    assert all(latch.handles(h) for h in seen.values()), seen
    assert_restored()
