"""JAX loops stopped by real signals: ``tests/scripts/flax_train.py`` (a Flax NNX loop shaped like
Flax's MNIST tutorial, dropout drawing from the model's ``nnx.Rngs``, Orbax checkpoints through
``preemptible.jax.PreemptibleLoop``) in its own process.

A stopped run must exit with the documented code and leave a committed ``checkpoint-N`` (Orbax's
``state/`` and the data position); the same command run again must resume at the next batch and
end with every array of the model and the optimizer (the dropout's PRNG key among them) equal,
bit for bit, to a run never stopped. One uninterrupted run of one process, and one of two
``jax.distributed`` processes (CPU, gloo), are shared by the tests.
"""

from __future__ import annotations

import importlib.util
import random
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Child, python_args, wait_for
from tests.support.buckets import Bucket
from tests.support.checkpoints import committed, same_values, temporaries
from tests.support.machines import Machine
from tests.support.reference import DIR, References, free_port, rank_env

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        importlib.util.find_spec("flax") is None or importlib.util.find_spec("orbax") is None,
        reason="the jax extra (jax, flax, orbax-checkpoint) is not installed",
    ),
]

STEP = re.compile(r"^step (\d+) loss ")
TOTAL = 18  # 3 epochs of 6 batches


def train_args(d: Path, *extra: str, ckpt: str | None = None) -> list[str]:
    """``ckpt``: where the checkpoints go (a bucket's URL, say), not ``d/ckpt``."""
    where = str(d / "ckpt") if ckpt is None else ckpt
    return python_args("flax_train.py", "--dir", where, "--out", str(d / "out.npz"), *extra)


def reference(references: References) -> Path:
    return references.result(train_args(Path(DIR))) / "out.npz"


def steps(child: Child) -> list[int]:
    return [int(m.group(1)) for line in child.lines if (m := STEP.match(line))]


def at_step(n: int) -> Callable[[str], bool]:
    return lambda line: (m := STEP.match(line)) is not None and int(m.group(1)) == n


def check_resumed(child: Child, d: Path, step: int) -> None:
    """``child`` resumed from ``checkpoint-<step>`` and trained the next step first."""
    assert f"resumed from {d / 'ckpt' / f'checkpoint-{step}'} at step {step}" in child.output
    assert steps(child)[0] == step + 1, child.output


def test_each_signal_at_a_random_step_resumes_exactly(
    reference_runs: References, tmp_path: Path, spawn
) -> None:
    """SIGTERM, SIGUSR1 and SIGINT, each at a random step of its own run: each run exits with
    128 + signum leaving ``checkpoint-<its last step>``, and the last run ends as the run never
    stopped did, bit for bit."""
    reference_runs.start(train_args(Path(DIR)))
    seed = random.randrange(1 << 30)
    # not the last steps: a signal that lands a step late must still find one to stop at
    stops = sorted(random.Random(seed).sample(range(1, TOTAL - 2), 3))
    step = 0
    for sig, at in zip((signal.SIGTERM, signal.SIGUSR1, signal.SIGINT), stops, strict=True):
        child = spawn(train_args(tmp_path, "--step-sleep", "0.05"))
        child.wait_line(at_step(at), timeout=120)
        child.signal(sig)
        rc = child.wait(60)
        assert rc == 128 + sig, f"seed {seed}: {sig.name} at {at}: exit {rc}\n{child.output}"
        if step:
            check_resumed(child, tmp_path, step)
        step = max(steps(child))  # the step the signal reached (or the next one)
        assert f"checkpoint-{step}" in committed(tmp_path / "ckpt", "checkpoint-*"), seed
        assert f"exiting with {128 + sig}" in child.output
        assert temporaries(tmp_path / "ckpt") == []
    last = spawn(train_args(tmp_path))
    assert last.wait(120) == 0, last.output
    check_resumed(last, tmp_path, step)
    assert f"done step={TOTAL}" in last.lines
    assert same_values(reference(reference_runs), tmp_path / "out.npz"), seed


def test_a_kill_mid_save_leaves_the_previous_checkpoint_and_a_second_int_exits_1(
    reference_runs: References, tmp_path: Path, spawn
) -> None:
    reference_runs.start(train_args(Path(DIR)))
    periodic = ("--save-every", "4", "--step-sleep", "0.05")
    # 1. Periodic saves at 4 and 8; the one at 12 is SIGKILLed while Orbax writes it.
    first = spawn(train_args(tmp_path, *periodic, "--slow-write", "60", "--slow-write-from", "12"))
    first.wait_line(lambda line: line == "writing 12", timeout=120)
    first.kill()
    ckpt = tmp_path / "ckpt"
    assert committed(ckpt, "checkpoint-*") == ["checkpoint-4", "checkpoint-8"]
    [torn] = temporaries(ckpt)

    # 2. Resumed from 8; SIGINT at 10 starts the stop's (slow) save, and a second SIGINT exits
    # at once with 1: nothing of step 10 is committed, the torn temporary of 12 is gone.
    second = spawn(train_args(tmp_path, *periodic, "--slow-write", "60"))
    second.wait_line(at_step(10), timeout=120)
    second.signal(signal.SIGINT)
    sent = time.monotonic()
    writing = second.wait_line(lambda line: line.startswith("writing "), timeout=30)
    assert writing in ("writing 10", "writing 11"), second.output  # the step it reached
    assert not torn.exists(), "the killed writer's temporary was not cleaned up"
    wait_for(lambda: time.monotonic() - sent > 0.6, 5, "the 0.5 s that makes it a 2nd signal")
    second.signal(signal.SIGINT)
    assert second.wait(30) == 1, second.output
    check_resumed(second, tmp_path, 8)
    assert committed(ckpt, "checkpoint-*") == ["checkpoint-4", "checkpoint-8"]

    # 3. Resumed from 8 again: the replay is exact.
    third = spawn(train_args(tmp_path, *periodic))
    assert third.wait(120) == 0, third.output
    check_resumed(third, tmp_path, 8)
    assert same_values(reference(reference_runs), tmp_path / "out.npz")


def test_a_run_stopped_on_one_machine_resumes_from_the_bucket_on_a_new_one(
    reference_runs: References, s3_bucket: Bucket, tmp_path: Path, spawn
) -> None:
    """The checkpoint directory is a bucket's URL. SIGTERM: ``checkpoint-N`` (Orbax's directory
    and the position) is committed in staging and uploaded before the process exits 143. On a
    new machine (the old one's disks gone) the same loop finds it in the bucket, resumes at the
    next step and ends as the run never stopped did, bit for bit."""
    reference_runs.start(train_args(Path(DIR)))
    url = f"{s3_bucket.url}/jax"
    one, two = Machine(tmp_path / "one"), Machine(tmp_path / "two")
    first = spawn(train_args(one.cwd, "--step-sleep", "0.05", ckpt=url), cwd=one.cwd, env=one.env)
    first.wait_line(at_step(7), timeout=120)
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 143, first.output
    step = max(steps(first))
    one.gone()
    second = spawn(train_args(two.cwd, ckpt=url), cwd=two.cwd, env=two.env)
    assert second.wait(120) == 0, second.output
    assert f"checkpoint-{step} at step {step}" in second.output
    assert steps(second)[0] == step + 1 and f"done step={TOTAL}" in second.lines
    assert same_values(reference(reference_runs), two.cwd / "out.npz")


STOPPED = re.compile(
    r"^preemptible: rank (\d): stopped at step (\d+) on (\w+); .* exiting with (\d+)$"
)


def launch(spawn: Callable[..., Child], d: Path, *extra: str) -> list[Child]:
    """Two ``jax.distributed`` processes of the loop (data parallel, one CPU device each)."""
    port = str(free_port())
    args = train_args(d, "--distributed", *extra)
    return [spawn(args, env=rank_env(r, 2, port)) for r in range(2)]


def test_two_processes_stop_at_the_same_step_when_one_is_signalled_and_resume_exactly(
    reference_runs: References, tmp_path: Path, spawn
) -> None:
    """SIGTERM to one of two ``jax.distributed`` processes (chosen at random) at a random step:
    both stop at the same step (agreed in JAX's coordination service, no collective per step),
    both exit 143 leaving one ``checkpoint-N`` with both positions, and the two resumed
    processes end as two never stopped did, bit for bit."""
    reference_runs.start(train_args(Path(DIR), "--distributed"), ranks=2)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    told, at = rng.randrange(2), rng.randrange(2, TOTAL - 4)
    first = launch(spawn, tmp_path, "--step-sleep", "0.05")
    first[told].wait_line(at_step(at), timeout=180)
    first[told].signal(signal.SIGTERM)
    codes = [child.wait(90) for child in first]
    assert codes == [143, 143], (seed, codes, [child.output for child in first])
    stopped = [[m.groups() for line in c.lines if (m := STOPPED.match(line))] for c in first]
    assert [len(found) for found in stopped] == [1, 1], [c.output for c in first]
    (r0, step0, source0, _), (r1, step1, source1, _) = stopped[0][0], stopped[1][0]
    assert (r0, r1) == ("0", "1") and step0 == step1 and source0 == source1 == "SIGTERM", seed
    step = int(step0)
    ckpt = tmp_path / "ckpt"
    assert committed(ckpt, "checkpoint-*") == [f"checkpoint-{step}"]
    assert sorted(p.name for p in (ckpt / f"checkpoint-{step}").glob("preemptible-*.json")) == [
        "preemptible-0.json",
        "preemptible-1.json",
    ]
    second = launch(spawn, tmp_path)
    assert [child.wait(180) for child in second] == [0, 0], [c.output for c in second]
    for child in second:
        check_resumed(child, tmp_path, step)
    reference = reference_runs.result(train_args(Path(DIR), "--distributed"), ranks=2)
    assert same_values(reference / "out.npz", tmp_path / "out.npz"), seed
