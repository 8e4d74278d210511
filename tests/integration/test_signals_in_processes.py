"""Signals to real training processes: the second signal, process groups, DataLoader workers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from preemptible.stop._signals import DUPLICATE_WINDOW
from tests.conftest import group_members, python_args, wait_for

pytestmark = pytest.mark.timeout(120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_second_signal_during_save_exits_1_within_a_second(tmp_path: Path, spawn) -> None:
    ckpt = tmp_path / "ckpt"
    child = spawn(
        python_args(
            "train.py",
            "--ckpt",
            str(ckpt),
            "--out",
            str(tmp_path / "o.pt"),
            "--steps",
            "1000",
            "--slow-save",
            "30",
            "--step-sleep",
            "0.01",
        )
    )
    child.wait_line(lambda line: line == "step 3", timeout=60)
    child.signal(signal.SIGTERM)
    child.wait_line(lambda line: line == "saving", timeout=30)
    # a person's second signal, not the same stop delivered twice: "saving" shows the first
    # was taken, so a second after DUPLICATE_WINDOW from here is a new one
    took = time.monotonic()
    wait_for(lambda: time.monotonic() - took > DUPLICATE_WINDOW + 0.2, 5, "the duplicate window")
    sent = time.monotonic()
    child.signal(signal.SIGTERM)
    rc = child.wait(10)
    elapsed = time.monotonic() - sent
    assert rc == 1, child.output
    assert elapsed < 1.0, f"took {elapsed:.2f} s to exit on the second signal"
    assert "received SIGTERM again" in child.output
    assert not list(ckpt.glob("step-*.ckpt")), "an interrupted save must not be committed"


@pytest.mark.parametrize(
    "sig",
    [signal.SIGTERM, signal.SIGINT],  # kill -TERM -PGID (Kubernetes, SLURM); Ctrl+C in a terminal
    ids=lambda s: s.name,
)
def test_group_signal_with_dataloader_workers_saves_and_exits(
    sig: signal.Signals, tmp_path: Path, spawn
) -> None:
    ckpt = tmp_path / "ckpt"
    child = spawn(
        python_args(
            "train.py",
            "--ckpt",
            str(ckpt),
            "--out",
            str(tmp_path / "o.pt"),
            "--steps",
            "10000",
            "--workers",
            "2",
            "--step-sleep",
            "0.02",
        )
    )
    child.wait_line(lambda line: line == "step 5", timeout=60)
    members = group_members(child.pid)
    assert len(members) >= 3, f"expected the trainer and 2 workers, found {members}"
    child.signal_group(sig)
    assert child.wait(60) == 128 + sig, child.output
    for failure in ("killed by signal", "exited unexpectedly", "KeyboardInterrupt"):
        assert failure not in child.output
    assert len(list(ckpt.glob("step-*.ckpt"))) == 1
    wait_for(lambda: not any(_alive(p) for p in members), 10, "workers to exit")


GRACE = 5


def test_grace_period_keeps_training_then_saves_again(tmp_path: Path, spawn) -> None:
    ckpt = tmp_path / "ckpt"
    child = spawn(
        python_args(
            "train.py",
            "--ckpt",
            str(ckpt),
            "--out",
            str(tmp_path / "o.pt"),
            "--steps",
            "100000",
            "--step-sleep",
            "0.05",
            "--grace",
            str(GRACE),
            "--keep",
            "5",
        )
    )
    child.wait_line(lambda line: line == "step 3", timeout=60)
    sent = time.time()
    child.signal(signal.SIGTERM)
    rc = child.wait(30)
    assert rc == 143, child.output
    files = sorted(ckpt.glob("step-*.ckpt"))
    saved = [int(p.name[5:15]) for p in files]
    assert len(saved) == 2, f"expected an insurance and a final checkpoint, got {saved}"
    assert saved[1] - saved[0] >= 10, "training should continue for most of the window"
    committed_after = files[1].stat().st_mtime - sent
    # the trainer keeps ~1.6 s of the window for its last steps, save and exit (more when the
    # machine is loaded): 0.4 x GRACE leaves room for that and still fails an early save
    assert 0.4 * GRACE < committed_after < GRACE, (
        f"final checkpoint committed {committed_after:.2f} s after the signal; grace {GRACE} s"
    )
