"""SLURM facts the supervisor needs: which job this is, when SLURM will kill it, requeueing.

Every ``scontrol`` call is bounded: slurmctld answers in milliseconds when it is healthy, and
when it is not (overloaded during a preemption storm, unreachable), the supervisor must still
forward signals, escalate and exit. A failure is a ``SlurmError`` that callers turn into a
fallback or a warning, never a crash.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime

from .._env import env_choice, env_str
from .._errors import ConfigError, SlurmError, SlurmUnreachable

logger = logging.getLogger("preemptible")

TIMEOUT = 3.0  # seconds for one scontrol call
# Escalate this long before SLURM's SIGKILL: the supervisor still has to kill the group, reap
# it, write the attempt's record and requeue (SLURM's own KILL came 0.3 s before KillWait here).
MARGIN = 2.0
# A job that SLURM ends further away than this is not being stopped by SLURM (the signal was
# a person's, or `scancel --signal`); SLURM's deadline then says nothing about this stop.
NEAR = 600.0
# While the job is allocated, SLURM's end is its EndTime; in any other state it is ending now.
_ALLOCATED = {"RUNNING", "SUSPENDED", "CONFIGURING", "RESIZING", "SIGNALING"}
_ID = re.compile(r"^[0-9]{1,18}$")


# After a call times out, further calls fail at once for a while: every second spent waiting
# on a stuck controller is a second the stop does not have.
QUIET_AFTER_TIMEOUT = 30.0
_stuck: list[tuple[float, SlurmUnreachable]] = []


def _digits(name: str) -> str | None:
    value = env_str(name)
    if value is not None and not _ID.fullmatch(value):
        raise ConfigError(f"{name}={value!r} is not valid; SLURM job ids are digits, e.g. 12345")
    return value


def job_id() -> str | None:
    """The id to requeue: ``ARRAYJOB_TASK`` for an array task, else the job id.

    The id names the run directory (``runs/slurm-<id>``), so anything but digits is refused:
    a crafted value would otherwise put the run outside --home.
    """
    job = _digits("SLURM_JOB_ID")
    array_job, task = _digits("SLURM_ARRAY_JOB_ID"), _digits("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return job


def requeue_mode() -> str:
    """``auto`` requeues a PREEMPTED attempt's job, ``never`` leaves it ended. There is no
    ``always``: a FAILED attempt is retried inside the allocation (--max-failures), and
    sending a broken job back to the queue would only loop it there."""
    return env_choice("PREEMPTIBLE_REQUEUE", ("auto", "never"), "auto") or "auto"


def in_batch_job() -> bool:
    return job_id() is not None and requeue_mode() != "never"


def scontrol(*args: str, timeout: float = TIMEOUT, fail_fast: bool = True) -> str:
    """stdout of ``scontrol ARGS``; a hung scontrol is killed with its whole process group.
    ``fail_fast``: raise at once while an earlier call's timeout is recent."""
    exe = shutil.which("scontrol")
    what = "scontrol " + " ".join(args)
    if exe is None:
        raise SlurmUnreachable("scontrol is not on PATH")
    if fail_fast and _stuck and time.monotonic() < _stuck[0][0]:
        raise _stuck[0][1]
    try:
        proc = subprocess.Popen(
            [exe, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except OSError as exc:
        raise SlurmError(f"cannot run {what}: {exc.strerror or exc}") from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        # a grandchild that left the group may still hold the pipes: stop waiting for it
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=1.0)
        proc.kill()
        proc.wait()
        error = SlurmUnreachable(f"{what} did not answer within {timeout:g} s")
        _stuck[:] = [(time.monotonic() + QUIET_AFTER_TIMEOUT, error)]
        raise error from None
    if proc.returncode != 0:
        lines = (err or out).strip().splitlines()
        raise SlurmError(f"{what} failed (exit {proc.returncode}): {lines[0] if lines else ''}")
    return out


def fields(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of ``scontrol show ... -o`` (values with spaces come out cut)."""
    return dict(f.split("=", 1) for f in text.split() if "=" in f)


_kill_wait: list[float] = []


def kill_wait() -> float:
    """KillWait: seconds from SLURM's SIGTERM to its SIGKILL of every process of the job.
    Cached once read; it is the cluster's configuration."""
    if not _kill_wait:
        m = re.search(r"^KillWait\s*=\s*(\d+)\s*sec", scontrol("show", "config"), re.MULTILINE)
        if m is None:
            raise SlurmError("scontrol show config has no KillWait line")
        _kill_wait.append(float(m.group(1)))
    return _kill_wait[0]


def job_fields(job: str) -> dict[str, str]:
    return fields(scontrol("show", "job", "-o", job))


def partition_fields(name: str) -> dict[str, str]:
    return fields(scontrol("show", "partition", name, "-o"))


def parse_time(text: str | None) -> float | None:
    """A SLURM timestamp (local time, ``2026-11-30T10:25:38``); None for Unknown/None/N/A."""
    try:
        return datetime.fromisoformat(text).timestamp() if text else None
    except ValueError:
        return None


@dataclass(frozen=True)
class KillDeadline:
    seconds: float  # from now to SLURM's SIGKILL
    why: str
    near: bool  # SLURM is ending the job now (or soon): this deadline bounds the stop


def deadline_from(wait: float, job: dict[str, str], now: float | None = None) -> KillDeadline:
    """When SLURM SIGKILLs the job, from KillWait and ``scontrol show job``.

    SLURM's kill sequence is SIGCONT + SIGTERM, then SIGKILL KillWait later, and it starts at
    the job's end: at once for scancel, a requeue and a preemption without grace (the job has
    left RUNNING); at EndTime for a running job. Once a job is picked for preemption,
    slurmctld sets its EndTime to now + the partition's GraceTime (and the grace SIGTERM goes
    to job steps only, not to the batch script), so EndTime already holds GraceTime.
    """
    now = time.time() if now is None else now
    state = job.get("JobState", "")
    end = parse_time(job.get("EndTime"))
    preempted = parse_time(job.get("PreemptTime")) is not None
    if state not in _ALLOCATED or (end is not None and end <= now):
        return KillDeadline(
            wait, f"SLURM's own SIGKILL: KillWait={wait:g} s, job {state or '?'}", True
        )
    if end is None:
        return KillDeadline(float("inf"), "no SLURM kill pending: no time limit", False)
    left = end - now
    cause = "preemption GraceTime ends" if preempted else "time limit"
    return KillDeadline(
        left + wait,
        f"SLURM's own SIGKILL: {cause} in {left:.0f} s + KillWait={wait:g} s",
        preempted or left + wait <= NEAR,
    )


def kill_deadline() -> KillDeadline | None:
    """SLURM's SIGKILL deadline for a stop signal received now; None outside SLURM or when
    KillWait cannot be read. When the job itself cannot be read, the job is assumed to be
    ending now: KillWait is the earliest SLURM ever kills."""
    job = job_id()
    if job is None:
        return None
    try:
        wait = kill_wait()
    except SlurmError as exc:
        logger.warning("preemptible: cannot read SLURM's KillWait: %s", exc)
        return None
    try:
        info = job_fields(job)
    except SlurmError as exc:
        logger.warning("preemptible: cannot read SLURM job %s: %s; assuming it is ending", job, exc)
        return KillDeadline(
            wait, f"SLURM's own SIGKILL: KillWait={wait:g} s, job state unknown", True
        )
    return deadline_from(wait, info)


def before_kill(seconds: float) -> float:
    """When to escalate, given SLURM's SIGKILL in ``seconds``: MARGIN before it (or halfway
    there for a KillWait shorter than twice the margin)."""
    return max(seconds - MARGIN, seconds / 2)


_LEFT = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")


def parse_time_left(text: str) -> float | None:
    """squeue's %L: ``[days-][hours:]minutes:seconds``; None for UNLIMITED/INVALID."""
    m = _LEFT.match(text.strip())
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def cancelled(job: dict[str, str]) -> bool:
    """Whether ``scontrol show job`` shows a job that someone cancelled (``scancel``): it has
    left RUNNING, not for its time limit (``Reason=TimeLimit``) nor for a preemption (a
    ``PreemptTime``). A plain scancel and a time limit send the same SIGTERM, then SIGKILL
    KillWait later; only SLURM's reason tells them apart (both show ``JobState=COMPLETING``)."""
    if job.get("JobState", "") in _ALLOCATED:
        return False
    if parse_time(job.get("PreemptTime")) is not None:
        return False
    return not job.get("Reason", "").startswith("TimeLimit")


def requeue() -> bool:
    """``scontrol requeue`` this job; logs one clear line and returns False when it fails.

    A job someone cancelled is not requeued, though its attempt was PREEMPTED (stopped, its
    newest checkpoint kept): ``scancel`` means the job should end, and a requeue would start it
    again (``cancelled``). When the job cannot be read, it is requeued, as before."""
    job = job_id()
    if job is None:
        return False
    try:
        info = job_fields(job)
    except SlurmError:
        info = {}
    if info and cancelled(info):
        logger.warning(
            "preemptible: SLURM job %s was cancelled (scancel): not requeued; submitting the "
            "same job script again resumes the run from its newest checkpoint",
            job,
        )
        return False
    try:
        scontrol("requeue", job, timeout=30.0, fail_fast=False)
    except SlurmError as exc:
        if shutil.which("scontrol") is None:
            logger.error(
                "preemptible: cannot requeue SLURM job %s: scontrol is not on PATH; the job "
                "ends as preempted instead. Put SLURM's client tools on PATH in the job script.",
                job,
            )
        else:
            logger.error("preemptible: %s; was the job submitted with --requeue?", exc)
        return False
    logger.warning("preemptible: requeued SLURM job %s", job)
    return True
