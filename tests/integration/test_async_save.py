"""Asynchronous saves with real processes: the loop trains while a (deliberately slow) writer
writes, kills and stops during a write, exact resume, a write the OS refuses."""

from __future__ import annotations

import random
import resource
import signal
from pathlib import Path

import pytest
import torch

from preemptible.checkpoint._store import CheckpointStore
from tests.conftest import python_args, wait_for
from tests.support.checkpoints import same_weights
from tests.support.reference import DIR, References

pytestmark = pytest.mark.timeout(180)

STEPS = 24
# the same command as test_exact_resume.py's reference: one run serves both
REFERENCE = python_args(
    "train.py", "--ckpt", f"{DIR}/ckpt", "--out", f"{DIR}/final.pt", "--steps", str(STEPS)
)


def train(tmp_path: Path, name: str, *extra: str, steps: int = STEPS) -> list[str]:
    return python_args(
        "train.py",
        "--ckpt",
        str(tmp_path / name),
        "--out",
        str(tmp_path / f"{name}.pt"),
        "--steps",
        str(steps),
        "--async-save",
        *extra,
    )


@pytest.fixture
def reference(reference_runs: References) -> Path:
    """The uninterrupted run, saving synchronously (how it saves changes no weight), shared
    with test_exact_resume.py."""
    return reference_runs.result(REFERENCE) / "final.pt"


def test_the_loop_keeps_training_while_a_slow_write_is_in_flight(tmp_path: Path, spawn) -> None:
    child = spawn(
        train(
            tmp_path,
            "c",
            "--save-every",
            "10",
            "--slow-write",
            "2",
            "--step-sleep",
            "0.01",
            steps=30,
        )
    )
    assert child.wait(120) == 0, child.output
    lines = child.lines
    start, end = lines.index("writing step 10"), lines.index("written step 10")
    trained = [line for line in lines[start:end] if line.startswith("step ")]
    # a synchronous save would allow none; the next save point (step 20) is the limit
    assert len(trained) >= 3, f"only {trained} ran while step 10 was being written"


def test_sigterm_during_a_write_commits_the_stop_step_and_resumes_exactly(
    tmp_path: Path, spawn, reference: Path
) -> None:
    child = spawn(
        train(
            tmp_path,
            "c",
            "--save-every",
            "4",
            "--slow-write",
            "1.5",
            "--step-sleep",
            "0.01",
            "--steps",
            str(STEPS),
        )
    )
    child.wait_line(lambda line: line == "writing step 4", timeout=60)
    line = child.wait_line(lambda line: line.startswith("step "), timeout=30)
    child.signal(signal.SIGTERM)
    assert child.wait(60) == 143, child.output
    stopped_at = int(line.split()[1]) + 1
    steps = [c.step for c in CheckpointStore(tmp_path / "c").committed()]
    assert steps[0] >= stopped_at and 4 in steps, (steps, child.output)
    resumed = spawn(train(tmp_path, "c", "--save-every", "4"))
    assert resumed.wait(120) == 0, resumed.output
    assert same_weights(reference, tmp_path / "c.pt")


def test_sigkill_during_writes_never_leaves_an_unloadable_newest(tmp_path: Path, spawn) -> None:
    rng = random.Random(7)
    ckpt = tmp_path / "c"
    inside = 0
    for _ in range(4):
        child = spawn(
            train(tmp_path, "c", "--save-every", "2", "--slow-write", "0.3", "--steps", "100000")
        )
        # kill while a write is in flight, or just after one, or between two
        target = rng.choice(["writing step", "written step", "step "])
        child.wait_line(lambda line: line.startswith("written step"), timeout=60)
        seen = len(child.lines)
        wait_for(
            lambda t=target, n=seen, c=child: any(x.startswith(t) for x in c.lines[n:]), 60, target
        )
        child.kill()
        inside += target == "writing step"
        newest = CheckpointStore(ckpt).latest()
        assert newest is not None
        payload = torch.load(newest.path, weights_only=True)
        assert payload["step"] == newest.step
    assert inside >= 1, "no kill landed inside a write"


def test_async_resume_after_sigkill_is_exact(tmp_path: Path, spawn, reference: Path) -> None:
    child = spawn(
        train(tmp_path, "c", "--save-every", "3", "--step-sleep", "0.02", "--steps", str(STEPS))
    )
    child.wait_line(lambda line: line == "step 14", timeout=60)
    child.kill()
    resumed = spawn(train(tmp_path, "c", "--save-every", "3"))
    assert resumed.wait(120) == 0, resumed.output
    assert "resumed from" in resumed.output
    assert same_weights(reference, tmp_path / "c.pt")


def _limit_file_size() -> None:  # in the child: file writes past 4 KiB fail (EFBIG)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))


def test_a_refused_background_write_is_reported_and_keeps_the_old_checkpoint(
    tmp_path: Path, spawn
) -> None:
    first = spawn(train(tmp_path, "c", "--save-every", "2", steps=4))
    assert first.wait(120) == 0, first.output
    before = {p.name: p.read_bytes() for p in (tmp_path / "c").glob("step-*.ckpt")}
    assert len(before) == 2 and min(len(b) for b in before.values()) > 4096
    second = spawn(train(tmp_path, "c", "--save-every", "2", steps=8), preexec_fn=_limit_file_size)
    rc = second.wait(120)
    assert "background checkpoint failed" in second.output, second.output
    assert "File too large" in second.output
    assert rc == 1, second.output  # the last save, at the end, is synchronous: refused too
    after = {p.name: p.read_bytes() for p in (tmp_path / "c").glob("step-*.ckpt")}
    assert after == before
