"""The new-machine test of the plain handler: checkpoints in a bucket outlive the machine.

``train.py --ckpt s3://bucket/ckpt`` is stopped (SIGTERM: the stop's checkpoint goes up before
the process exits; SIGKILL at a random moment while periodic checkpoints go up), then the same
command runs in a fresh working directory with a new HOME and TMPDIR (the old ones deleted, so
nothing of the first machine's staging is left) and ends bit for bit equal to a run never
stopped (the reference of tests/integration/test_exact_resume.py, run once per session).
"""

from __future__ import annotations

import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import python_args
from tests.support.buckets import Bucket
from tests.support.checkpoints import same_weights
from tests.support.reference import DIR, References

STEPS = 24
pytestmark = pytest.mark.timeout(240)

# the uninterrupted run: the very command of test_exact_resume.py, so one run serves both
REFERENCE = python_args(
    "train.py", "--ckpt", f"{DIR}/ckpt", "--out", f"{DIR}/final.pt", "--steps", str(STEPS)
)


class Machine:
    """A fresh working directory, HOME and TMPDIR: what a new VM starts with."""

    def __init__(self, root: Path, bucket: Bucket) -> None:
        self.root = root
        for d in ("work", "home", "tmp"):
            (root / d).mkdir(parents=True)
        self.env = {
            **bucket.env,
            "HOME": str(root / "home"),
            "TMPDIR": str(root / "tmp"),
            "PREEMPTIBLE_STAGING_DIR": "",  # the default: under HOME's cache
            "XDG_CACHE_HOME": "",
        }

    @property
    def cwd(self) -> Path:
        return self.root / "work"

    def staging(self) -> list[Path]:
        return sorted((self.root / "home" / ".cache" / "preemptible" / "staging").glob("*/*"))

    def delete(self) -> None:
        shutil.rmtree(self.root)


def train(bucket: Bucket, *extra: str) -> list[str]:
    # --out is relative: it lands in the machine's working directory
    return python_args(
        "train.py", "--ckpt", bucket.url, "--out", "final.pt", "--steps", str(STEPS), *extra
    )


# Azure's run (Azurite): the SIGKILL case alone, where uploads are cut at random moments; GCS's
# (fake-gcs-server): the SIGTERM case, the stop's checkpoint going up before the exit (the
# protocol is the same on all three; test time is budgeted)
@pytest.mark.parametrize(
    ("bucket", "sig"),
    [
        ("s3", signal.SIGTERM),
        ("s3", signal.SIGKILL),
        ("az", signal.SIGKILL),
        ("gs", signal.SIGTERM),
    ],
    ids=["s3-SIGTERM", "s3-SIGKILL", "az-SIGKILL", "gs-SIGTERM"],
    indirect=["bucket"],
)
def test_a_run_resumes_on_a_new_machine_from_the_bucket_exactly(
    sig: signal.Signals, bucket: Bucket, reference_runs: References, tmp_path: Path, spawn
) -> None:
    reference_runs.start(REFERENCE)
    rng = random.Random(f"bucket-{sig.name}")
    stop_at = rng.randrange(5, STEPS - 4)
    args = train(bucket, "--save-every", "2", "--step-sleep", "0.05")
    first = Machine(tmp_path / "first", bucket)
    run = spawn(args, cwd=first.cwd, env=first.env)
    run.wait_line(lambda line: line == f"step {stop_at}", timeout=90)
    if sig == signal.SIGKILL:  # some moment of the step, while saves go up
        time.sleep(rng.uniform(0.0, 0.1))  # not a wait for anything: the moment is random
    run.signal(sig)
    rc = run.wait(90)
    assert rc == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig.value), run.output
    assert first.staging(), "the first machine staged nothing"
    manifests = [k for k in bucket.objects() if k.startswith("manifests/step-")]
    assert manifests, "nothing reached the bucket"
    if sig == signal.SIGTERM:  # the stop's checkpoint went up before the exit
        stopped = next(line for line in run.lines if "stopped at step" in line)
        step = int(stopped.split("stopped at step ")[1].split()[0])
        assert any(f"step-{step:010d}.ckpt" in k for k in manifests), (manifests, run.output)
    first.delete()

    second = Machine(tmp_path / "second", bucket)
    again = spawn(args, cwd=second.cwd, env=second.env)
    assert again.wait(180) == 0, again.output
    resumed = int(next(line for line in again.lines if line.startswith("resumed ")).split()[1])
    assert resumed >= 2, again.output
    assert "brought step-" in again.output, again.output
    # the run's last checkpoint went up before the interpreter exited (atexit's flush)
    last = f"manifests/step-{STEPS:010d}.ckpt/"
    assert any(k.startswith(last) for k in bucket.objects()), again.output
    reference = reference_runs.result(REFERENCE) / "final.pt"
    assert same_weights(reference, second.cwd / "final.pt")
