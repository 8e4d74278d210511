"""Keras 3 fits stopped by real signals and notices, on the torch, TensorFlow and JAX backends.

Each fit is ``tests/scripts/keras_fit.py`` in its own process (a tiny model with dropout,
``shuffle=True``, Adam). A stopped fit must exit with the documented code and leave a committed
checkpoint; the same command run again must resume at the next batch (the done batches of the
epoch are drawn, not trained: the optimizer's iteration count does not move on them) and end
with every model and optimizer variable equal, bit for bit, to a fit never stopped. One
uninterrupted fit per (backend, input) is shared by the tests; it runs beside the first of them.
"""

from __future__ import annotations

import importlib.util
import random
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import Child, python_args, wait_for
from tests.support.buckets import Bucket
from tests.support.checkpoints import committed, same_values, temporaries
from tests.support.machines import Machine
from tests.support.metadata import MetadataServer
from tests.support.reference import DIR, References

pytestmark = [
    pytest.mark.timeout(300),
    # looked up, not imported: keras here would pick a backend for the whole test process
    pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="keras not installed"),
]

BATCH = re.compile(r"^batch (\d+) (\d+) it=(\d+)$")
EPOCHS = {"array": "6", "pydataset": "3", "tfdata": "3"}  # 6 batches an epoch
TOTAL = {"array": 36, "pydataset": 18, "tfdata": 18}
BACKENDS = ("torch", "tensorflow", "jax")


def start_reference(references: References, backend: str, data: str) -> None:
    references.start(keras_fit_args(Path(DIR), data), {"KERAS_BACKEND": backend})


def reference_out(references: References, backend: str, data: str) -> Path:
    """The uninterrupted fit's weights (the session's shared reference runs)."""
    return (
        references.result(keras_fit_args(Path(DIR), data), {"KERAS_BACKEND": backend}) / "out.npz"
    )


def keras_fit_args(d: Path, data: str, *extra: str, ckpt: str | None = None) -> list[str]:
    """``ckpt``: where the checkpoints go (a bucket's URL, say), not ``d/ckpt``."""
    where = str(d / "ckpt") if ckpt is None else ckpt
    return python_args(
        "keras_fit.py",
        *("--dir", where, "--out", str(d / "out.npz"), "--data", data),
        *("--epochs", EPOCHS[data], *extra),
    )


def iterations(line: str) -> int | None:
    m = BATCH.match(line)
    return int(m.group(3)) if m else None


def at_iteration(n: int) -> Callable[[str], bool]:
    return lambda line: iterations(line) == n


def check_resumed(child: Child, d: Path, step: int) -> None:
    """``child`` resumed from ``keras-<step>.npz``: the batches it drew before its first
    trained one left the optimizer's iterations at ``step``."""
    assert f"resumed from {d / 'ckpt' / f'keras-{step}.npz'} at step {step}" in child.output
    counts = [n for line in child.lines if (n := iterations(line)) is not None]
    first = next(i for i, n in enumerate(counts) if n != step)
    done_in_epoch = (step - 1) % 6 + 1  # a stop at an epoch's last batch resumes in its end
    assert counts[first] == step + 1 and first == done_in_epoch, (first, counts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_signal_at_a_random_batch_resumes_exactly(
    backend: str, reference_runs: References, tmp_path: Path, spawn
) -> None:
    start_reference(reference_runs, backend, "array")
    env = {"KERAS_BACKEND": backend}
    seed = random.randrange(1 << 30)
    # not the last batches: a signal that lands a batch late must still find one to stop at
    stops = sorted(random.Random(seed).sample(range(1, TOTAL["array"] - 2), 3))
    step = 0
    for sig, at in zip((signal.SIGTERM, signal.SIGINT, signal.SIGUSR1), stops, strict=True):
        child = spawn(keras_fit_args(tmp_path, "array", "--step-sleep", "0.05"), env=env)
        child.wait_line(at_iteration(at), timeout=120)
        child.signal(sig)
        rc = child.wait(60)
        assert rc == 128 + sig, f"seed {seed}: {sig.name} at {at}: exit {rc}\n{child.output}"
        if step:
            check_resumed(child, tmp_path, step)
        # the stop is acted on at the batch the signal reached (or the next one)
        step = max(n for line in child.lines if (n := iterations(line)) is not None)
        assert f"keras-{step}.npz" in committed(tmp_path / "ckpt", "keras-*.npz"), (
            seed,
            committed(tmp_path / "ckpt", "keras-*.npz"),
        )
        assert f"exiting with {128 + sig}" in child.output
        assert temporaries(tmp_path / "ckpt") == []
    last = spawn(keras_fit_args(tmp_path, "array"), env=env)
    assert last.wait(120) == 0, last.output
    check_resumed(last, tmp_path, step)
    assert f"fit done it={TOTAL['array']}" in last.lines
    assert same_values(reference_out(reference_runs, backend, "array"), tmp_path / "out.npz"), seed


# not on JAX: the kill and the double signal are the kit's, the same on every backend; JAX's
# own part of a save mid-epoch (fit's state synced into the variables) runs in the test above
@pytest.mark.parametrize(("backend", "data"), [("torch", "pydataset"), ("tensorflow", "tfdata")])
def test_a_kill_mid_save_leaves_the_previous_checkpoint_and_a_second_signal_exits_1(
    backend: str, data: str, reference_runs: References, tmp_path: Path, spawn
) -> None:
    start_reference(reference_runs, backend, data)
    env = {"KERAS_BACKEND": backend}
    periodic = ("--save-every", "4", "--step-sleep", "0.05")
    # 1. Periodic saves at 4 and 8; the one at 12 is SIGKILLed halfway through its write.
    slow = ("--slow-write", "60", "--slow-write-from", "12")
    first = spawn(keras_fit_args(tmp_path, data, *periodic, *slow), env=env)
    first.wait_line(lambda line: line == "writing 12", timeout=120)
    first.kill()
    assert committed(tmp_path / "ckpt", "keras-*.npz") == ["keras-4.npz", "keras-8.npz"]
    [torn] = temporaries(tmp_path / "ckpt")

    # 2. Resumed from 8; SIGTERM at 10 starts the stop's (slow) save, and a second SIGTERM
    # exits at once with 1: nothing of step 10 is committed.
    second = spawn(keras_fit_args(tmp_path, data, *periodic, "--slow-write", "60"), env=env)
    second.wait_line(at_iteration(10), timeout=120)
    second.signal(signal.SIGTERM)
    sent = time.monotonic()
    writing = second.wait_line(lambda line: line.startswith("writing "), timeout=30)
    assert writing in ("writing 10", "writing 11"), second.output  # the batch it reached
    assert not torn.exists(), "the killed writer's temporary was not cleaned up"
    wait_for(lambda: time.monotonic() - sent > 0.6, 5, "the 0.5 s that makes it a 2nd signal")
    second.signal(signal.SIGTERM)
    assert second.wait(30) == 1, second.output
    check_resumed(second, tmp_path, 8)
    assert committed(tmp_path / "ckpt", "keras-*.npz") == ["keras-4.npz", "keras-8.npz"]

    # 3. Resumed from 8 again: the replay is exact.
    third = spawn(keras_fit_args(tmp_path, data, *periodic), env=env)
    assert third.wait(120) == 0, third.output
    check_resumed(third, tmp_path, 8)
    assert same_values(reference_out(reference_runs, backend, data), tmp_path / "out.npz")


WINDOW = 6.0  # seconds of notice the fake GCE gives


def test_a_gce_notice_saves_insurance_then_stops_before_the_deadline(tmp_path: Path, spawn) -> None:
    with MetadataServer() as server:
        env = {
            "KERAS_BACKEND": "torch",
            "GCE_METADATA_HOST": server.host,
            "PREEMPTIBLE_GCE_NOTICE_SECONDS": str(WINDOW),
            "PREEMPTIBLE_POLL_INTERVAL": "0.2",
        }
        first = spawn(keras_fit_args(tmp_path, "array", "--step-sleep", "0.25"), env=env)
        first.wait_line(at_iteration(3), timeout=120)
        noticed = time.time()
        server.state.gce_preempted = "TRUE"
        final = first.wait_line(lambda line: "then stopping" in line, timeout=30)
        assert first.wait(60) == 143, first.output
    out = first.lines
    insurance = next(i for i, line in enumerate(out) if "insurance checkpoint" in line)
    trained = [n for line in out[insurance : out.index(final)] if (n := iterations(line))]
    assert len(trained) >= 3, f"training should go on after the insurance save\n{first.output}"
    step = max(n for line in out if (n := iterations(line)) is not None)
    final_ckpt = tmp_path / "ckpt" / f"keras-{step}.npz"
    in_window = final_ckpt.stat().st_mtime - noticed
    assert 0.3 * WINDOW < in_window < WINDOW, f"final checkpoint {in_window:.2f} s after notice"
    assert temporaries(tmp_path / "ckpt") == []  # a resume from it is as any other (tests above)


def test_a_fit_stopped_on_one_machine_resumes_from_the_bucket_on_a_new_one(
    reference_runs: References, s3_bucket: Bucket, tmp_path: Path, spawn
) -> None:
    """The checkpoint directory is a bucket's URL. SIGTERM: keras-N.npz is committed in
    staging and uploaded before the process exits 143. On a new machine (the old one's disks
    gone) the same fit finds it in the bucket, resumes at the next batch and ends with every
    variable equal to a fit never stopped."""
    start_reference(reference_runs, "torch", "array")
    url = f"{s3_bucket.url}/keras"
    one, two = Machine(tmp_path / "one"), Machine(tmp_path / "two")
    env = {"KERAS_BACKEND": "torch"}
    first = spawn(
        keras_fit_args(one.cwd, "array", "--step-sleep", "0.05", ckpt=url),
        cwd=one.cwd,
        env={**one.env, **env},
    )
    first.wait_line(at_iteration(10), timeout=120)
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 143, first.output
    step = max(n for line in first.lines if (n := iterations(line)) is not None)
    one.gone()
    second = spawn(keras_fit_args(two.cwd, "array", ckpt=url), cwd=two.cwd, env={**two.env, **env})
    assert second.wait(120) == 0, second.output
    assert "resumed from " in second.output and f"keras-{step}.npz at step {step}" in second.output
    assert f"fit done it={TOTAL['array']}" in second.lines
    assert same_values(reference_out(reference_runs, "torch", "array"), two.cwd / "out.npz")


# -- a model with state of its own: keras-io's GAN ---------------------------------------------


def gan_args(d: Path, *extra: str) -> list[str]:
    out = str(d / "out.npz")
    return python_args("keras_gan.py", "--dir", str(d / "ckpt"), "--out", out, *extra)


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])  # its train_step is theirs
def test_a_gan_with_its_own_optimizers_resumes_exactly(
    backend: str, reference_runs: References, tmp_path: Path, spawn
) -> None:
    """keras-io's GAN keeps ``d_optimizer`` and ``g_optimizer`` on the model and overrides
    ``train_step``. SIGTERM mid-epoch: the checkpoint holds both Adams (and not the default
    optimizer ``compile()`` made and nothing steps); the resumed fit ends with every model and
    optimizer variable equal to a fit never stopped."""
    env = {"KERAS_BACKEND": backend}
    reference_runs.start(gan_args(Path(DIR)), env)
    first = spawn(gan_args(tmp_path, "--step-sleep", "0.05"), env=env)
    first.wait_line(at_iteration(8), timeout=120)
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 143, first.output
    step = max(n for line in first.lines if (n := iterations(line)) is not None)
    [name] = committed(tmp_path / "ckpt", "keras-*.npz")
    assert name == f"keras-{step}.npz"
    with np.load(tmp_path / "ckpt" / name, allow_pickle=False) as npz:
        groups = {k.rpartition("/")[0] for k in npz.files if not k.startswith(("rng/", "meta"))}
    assert groups == {"model", "metrics", "optimizer:d_optimizer", "optimizer:g_optimizer"}
    second = spawn(gan_args(tmp_path), env=env)
    assert second.wait(120) == 0, second.output
    check_resumed(second, tmp_path, step)
    assert "fit done it=18" in second.lines
    reference = reference_runs.result(gan_args(Path(DIR)), env) / "out.npz"
    assert same_values(reference, tmp_path / "out.npz")


def test_a_model_holding_state_the_checkpoint_would_miss_is_refused(tmp_path: Path, spawn) -> None:
    child = spawn(gan_args(tmp_path, "--hold-numpy-rng"), env={"KERAS_BACKEND": "torch"})
    assert child.wait(120) != 0, child.output
    assert "cannot resume this fit exactly: the model's attribute 'noise' is a numpy" in (
        child.output
    )
    assert committed(tmp_path / "ckpt", "keras-*.npz") == []
