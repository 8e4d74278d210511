"""SLURM facts the supervisor needs: which job this is, how long it has left, requeueing."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess

logger = logging.getLogger("preemptible")


def job_id() -> str | None:
    """The id to requeue: ``ARRAYJOB_TASK`` for an array task, else the job id."""
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return os.environ.get("SLURM_JOB_ID") or None


def in_batch_job() -> bool:
    return job_id() is not None and os.environ.get("PREEMPTIBLE_REQUEUE", "auto") != "never"


_LEFT = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")


def parse_time_left(text: str) -> float | None:
    """squeue's %L: ``[days-][hours:]minutes:seconds``; None for UNLIMITED/INVALID."""
    m = _LEFT.match(text.strip())
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def time_left() -> float | None:
    job = job_id()
    squeue = shutil.which("squeue")
    if job is None or squeue is None:
        return None
    try:
        out = subprocess.run(
            [squeue, "-h", "-j", job, "-o", "%L"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_time_left(out.stdout) if out.returncode == 0 else None


def requeue() -> bool:
    """``scontrol requeue`` this job; logs one clear line and returns False when it fails."""
    job = job_id()
    if job is None:
        return False
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        logger.error(
            "preemptible: cannot requeue SLURM job %s: scontrol is not on PATH; the job ends "
            "as preempted instead. Put SLURM's client tools on PATH in the job script.",
            job,
        )
        return False
    try:
        out = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.error("preemptible: scontrol requeue %s failed: %s", job, exc)
        return False
    if out.returncode != 0:
        logger.error(
            "preemptible: scontrol requeue %s failed (exit %d): %s; was the job submitted "
            "with --requeue?",
            job,
            out.returncode,
            (out.stderr or out.stdout).strip(),
        )
        return False
    logger.warning("preemptible: requeued SLURM job %s", job)
    return True
