"""Stop a real training process with a real signal at a random step; resume; compare weights.

The reference is the same script run without interruption. Equality is bit for bit
(``torch.equal``), not approximate.
"""

from __future__ import annotations

import random
import re
import signal
from pathlib import Path

import pytest
import torch

from tests.conftest import python_args
from tests.support.checkpoints import committed
from tests.support.reference import DIR, References

STEPS = 24
STEP = re.compile(r"step \d+")  # train.py prints it as a step starts
pytestmark = pytest.mark.timeout(180)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), f"{name} differs after resume"


# the uninterrupted run (one per session: test_async_save.py compares with the same one)
REFERENCE = python_args(
    "train.py", "--ckpt", f"{DIR}/ckpt", "--out", f"{DIR}/final.pt", "--steps", str(STEPS)
)


@pytest.fixture
def reference(reference_runs: References) -> Path:
    return reference_runs.result(REFERENCE) / "final.pt"


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2], ids=lambda s: s.name
)
def test_signal_then_resume_is_bit_exact(
    sig: signal.Signals, reference: Path, tmp_path: Path, spawn
) -> None:
    stop_at = random.Random(sig.value).randrange(2, STEPS - 3)
    ckpt, out = tmp_path / "ckpt", tmp_path / "final.pt"
    args = python_args(
        "train.py",
        "--ckpt",
        str(ckpt),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--step-sleep",
        "0.05",
    )
    first = spawn(args)
    first.wait_line(lambda line: line == f"step {stop_at}", timeout=60)
    first.signal(sig)
    rc = first.wait(60)
    assert rc == 128 + sig.value, first.output
    assert not out.exists(), "the interrupted run must not reach the end"
    saved = committed(ckpt)
    assert len(saved) == 1, saved
    stopped_step = int(saved[0][5:15])
    # the step running when the stop was seen is finished, and no other started (how late the
    # signal lands after "step stop_at" is the machine's business)
    last = max(int(line.split()[1]) for line in first.lines if STEP.fullmatch(line))
    assert stopped_step == last + 1 and last >= stop_at, (stopped_step, first.output)
    assert f"received {sig.name}" in first.output

    second = spawn(args)
    assert second.wait(120) == 0, second.output
    assert f"resumed {stopped_step}" in second.lines
    assert_same_weights(reference, out)


def test_sigkill_with_periodic_saves_loses_at_most_the_interval(
    reference: Path, tmp_path: Path, spawn
) -> None:
    every = 4
    ckpt, out = tmp_path / "ckpt", tmp_path / "final.pt"
    args = python_args(
        "train.py",
        "--ckpt",
        str(ckpt),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--save-every",
        str(every),
        "--step-sleep",
        "0.02",
    )
    kill_at = random.Random(7).randrange(every + 1, STEPS - 2)
    first = spawn(args)
    first.wait_line(lambda line: line == f"step {kill_at}", timeout=60)
    first.signal(signal.SIGKILL)
    assert first.wait(30) == -signal.SIGKILL
    second = spawn(args)
    assert second.wait(120) == 0, second.output
    resumed = int(second.wait_line(lambda line: line.startswith("resumed "), 1).split()[1])
    # the kill lands in some step at or after kill_at; step `last` was running, so steps up to
    # last - 1 were done and step-`last + 1` may already be committed
    last = max(int(line.split()[1]) for line in first.lines if STEP.fullmatch(line))
    assert last + 1 - every <= resumed <= last + 1, (last, resumed)
    assert_same_weights(reference, out)


def test_resume_of_a_finished_run_does_nothing(tmp_path: Path, spawn) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "final.pt"
    args = python_args(
        "train.py", "--ckpt", str(ckpt), "--out", str(out), "--steps", "6", "--save-every", "3"
    )
    assert spawn(args).wait(120) == 0
    again = spawn(args)
    assert again.wait(120) == 0
    assert "resumed 6" in again.lines
    assert not any(line.startswith("step ") for line in again.lines)
