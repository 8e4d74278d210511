"""A real single-node SLURM cluster (started by tests/services/with-services.sh).

sbatch a job that runs ``preemptible run``; ``scancel --batch --signal=USR1`` it the way
``--signal=B:USR1@T`` would; the supervisor passes the signal on, the trainer saves, the
supervisor requeues the job; SLURM starts it again with SLURM_RESTART_COUNT=1, it resumes and
COMPLETES with the exact final weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch

from preemptible.notices._sources import SlurmTimeLimit
from tests.conftest import SCRIPTS, wait_for
from tests.support.slurm import job_field

pytestmark = pytest.mark.timeout(300)


def test_usr1_requeue_resume_complete_bit_exact(sbatch, tmp_path: Path) -> None:
    py = sys.executable
    train = [py, str(SCRIPTS / "train.py"), "--ckpt", "ck", "--steps", "40", "--step-sleep", "0.1"]
    ref = subprocess.run(
        [*train[:3], str(tmp_path / "refck"), "--out", str(tmp_path / "ref.pt"), "--steps", "40"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ref.returncode == 0, ref.stderr
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"cd {tmp_path}\n"
        'echo "restart_count=${SLURM_RESTART_COUNT:-unset}"\n'
        f"exec {py} -m preemptible run --checkpoint-dir ck -- {' '.join(train)} --out o.pt\n"
    )
    out = tmp_path / "job.out"
    job = sbatch("--requeue", "--open-mode=append", "-o", str(out), str(script))
    wait_for(lambda: out.exists() and "\nstep 5\n" in out.read_text(), 60, "step 5 in the job")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True, timeout=30)
    wait_for(lambda: job_field(job, "JobState") == "COMPLETED", 180, "the job to complete")
    text = out.read_text()
    assert job_field(job, "Restarts") == "1", text
    assert "restart_count=unset" in text and "restart_count=1" in text
    assert "PREEMPTED (killed by SIGUSR1)" in text or "PREEMPTED (exit 138)" in text, text
    assert f"requeued SLURM job {job}" in text
    assert "resuming from" in text and "FINISHED (exit 0)" in text
    runs = tmp_path / ".preemptible" / "runs" / f"slurm-{job}"
    assert sorted(p.name for p in runs.glob("attempt-*")) == ["attempt-1", "attempt-2"]
    a = torch.load(tmp_path / "ref.pt", weights_only=True)
    b = torch.load(tmp_path / "o.pt", weights_only=True)
    assert a and a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_end_time_watcher_reads_the_real_job(sbatch, tmp_path: Path) -> None:
    job = sbatch("--time=10", "-o", "/dev/null", "--wrap", "sleep 300")
    wait_for(lambda: job_field(job, "JobState") == "RUNNING", 60, "the job to start")
    start = job_field(job, "StartTime")
    assert start is not None
    expected = datetime.fromisoformat(start).timestamp() + 600
    watcher = SlurmTimeLimit(job, lead=300)
    assert watcher.end_time() == expected
    assert watcher.poll() is None, "10 minutes left is more than the 5 minute lead"
    notice = SlurmTimeLimit(job, lead=700).poll()
    assert notice is not None and notice.source == "slurm-time-limit"
    assert notice.deadline == expected - 10


def test_time_limit_without_signal_saves_before_the_limit(sbatch, tmp_path: Path) -> None:
    """No --signal: the end-time watcher alone gets the run saved, requeued and finished."""
    py = sys.executable
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"cd {tmp_path}\n"
        f"exec {py} -m preemptible run --checkpoint-dir ck -- {py} {SCRIPTS / 'train.py'} "
        "--ckpt ck --out o.pt --steps 650 --step-sleep 0.1 --keep 5\n"
    )
    out = tmp_path / "job.out"
    job = sbatch("--requeue", "--open-mode=append", "--time=1", "-o", str(out), str(script))
    wait_for(lambda: job_field(job, "JobState") == "COMPLETED", 240, "the job to complete")
    text = out.read_text()
    assert "reaches its time limit" in text
    assert "stopped at step" in text and "on slurm-time-limit" in text
    assert f"requeued SLURM job {job}" in text and "FINISHED (exit 0)" in text
    assert "TIMEOUT" not in (job_field(job, "JobState") or "")
    assert (tmp_path / "o.pt").exists()


def test_doctor_inside_a_job(sbatch, tmp_path: Path) -> None:
    out = tmp_path / "doctor.json"
    job = sbatch(
        "--requeue",
        "--time=30",
        "-o",
        "/dev/null",
        "--wrap",
        f"{sys.executable} -m preemptible doctor --json > {out}",
    )
    wait_for(lambda: job_field(job, "JobState") == "COMPLETED", 60, "the doctor job")
    checks = {c["name"]: c for c in json.loads(out.read_text())}
    assert checks["platform"]["detail"].startswith("slurm (SLURM_JOB_ID is set)")
    assert checks["slurm"]["status"] == "ok" and "Requeue=1" in checks["slurm"]["detail"]
    assert "ends at its time limit" in checks["notices (slurm)"]["detail"]
    assert (
        "SLURM job's time left" in checks["term-timeout"]["detail"]
        or "default" in checks["term-timeout"]["detail"]
    )
