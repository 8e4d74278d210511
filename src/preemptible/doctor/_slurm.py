"""``preemptible doctor``'s SLURM checks: the job as ``scontrol`` describes it (read once),
its time limit, its requeue setting, and SLURM's kill deadline after its own SIGTERM."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .._errors import ConfigError, SlurmError
from ._check import INFO, OK, WARN, Check


@dataclass
class _Slurm:
    """This SLURM job as ``scontrol show job`` describes it, read once for all the checks."""

    job: str
    info: dict[str, str] = field(default_factory=dict)
    error: str = ""  # why ``info`` is empty


def _read_slurm() -> _Slurm | None:
    from ..supervisor._slurm import job_fields, job_id

    job = job_id()  # a ConfigError here is the "slurm" check's WARN
    if job is None:
        return None
    try:
        return _Slurm(job, job_fields(job))
    except SlurmError as exc:
        return _Slurm(job, error=str(exc))


def _slurm_end(slurm: _Slurm | None, lead: float) -> Check:
    from ..supervisor._slurm import parse_time

    if slurm is None:
        return Check("notices (slurm)", WARN, "no valid SLURM job id: see the slurm check")
    if not slurm.info:
        return Check(
            "notices (slurm)",
            WARN,
            f"cannot read the job's end time: {slurm.error}",
            "put SLURM's scontrol on PATH and check that slurmctld answers (scontrol ping)",
        )
    end = parse_time(slurm.info.get("EndTime"))
    if slurm.info.get("TimeLimit") in (None, "UNLIMITED", "Partition_Limit") or end is None:
        return Check("notices (slurm)", OK, f"job {slurm.job} has no time limit")
    return Check(
        "notices (slurm)",
        OK,
        f"job {slurm.job} ends at its time limit in {end - time.time():.0f} s; notice "
        f"{lead:.0f} s before",
    )


def _slurm_job(slurm: _Slurm | None) -> list[Check]:
    from ..supervisor._slurm import requeue_mode

    if slurm is None:
        return []
    if not slurm.info:
        return [
            Check(
                "slurm",
                WARN,
                f"job {slurm.job}, but {slurm.error}: preemptible run cannot read the job's "
                "deadlines or requeue a preempted run",
                "put SLURM's client tools on PATH and check that slurmctld answers (scontrol ping)",
            )
        ]
    requeue = slurm.info.get("Requeue") == "1"
    checks = [
        Check(
            "slurm",
            OK if requeue else WARN,
            f"job {slurm.job}: Requeue={slurm.info.get('Requeue', '?')}, "
            f"TimeLimit={slurm.info.get('TimeLimit', '?')}",
            "" if requeue else "submit with sbatch --requeue so preemptible run can requeue it",
        ),
        Check(
            "slurm signal",
            INFO,
            "SLURM does not show whether the job was submitted with --signal; without it the "
            "first warning is the SIGTERM at the time limit (preemptible also watches the job's "
            "end time)",
            "submit with --signal=B:USR1@120 and exec preemptible run in the batch script",
        ),
    ]
    try:
        if requeue_mode() == "never":
            checks.append(
                Check("slurm requeue", INFO, "PREEMPTIBLE_REQUEUE=never: a preempted run ends")
            )
    except ConfigError as exc:
        checks.append(Check("slurm requeue", WARN, str(exc)))
    return checks


def _slurm_kill(
    slurm: _Slurm, explicit: float | None, grace: float | None
) -> tuple[str, list[str], list[str]]:
    """SLURM's KillWait/GraceTime and what preemptible run does on SLURM's own stop."""
    from ..supervisor._slurm import before_kill, kill_wait, partition_fields

    try:
        wait = kill_wait()
    except SlurmError as exc:
        return (
            f"cannot read SLURM's KillWait ({exc}), and neither can preemptible run: SLURM's "
            "SIGKILL may come before its escalation",
            ["the deadline after SLURM's SIGTERM is unknown"],
            ["check that slurmctld answers (scontrol show config)"],
        )
    part = slurm.info.get("Partition", "")
    note = ""
    if part:
        try:
            p = partition_fields(part)
            note = f"; partition {part}: PreemptMode={p.get('PreemptMode', '?')}, "
            note += f"GraceTime={p.get('GraceTime', '?')} s"
            if p.get("PreemptMode", "OFF") != "OFF" and p.get("GraceTime", "0") != "0":
                note += " (a preempted job runs until then, and then gets the same SIGTERM)"
        except SlurmError as exc:
            note = f"; partition {part}: {exc}"
    problems, fixes = [], []
    if explicit is not None:
        at, source = explicit, "--term-timeout"
        if explicit > wait:
            problems.append(f"PREEMPTIBLE_TERM_TIMEOUT={explicit:g} s is longer than KillWait")
            fixes.append(f"unset PREEMPTIBLE_TERM_TIMEOUT or use {before_kill(wait):g} or less")
    else:
        at, source = before_kill(wait), "KillWait minus a margin"
        if grace is not None and max(grace - 2.0, 1.0) < at:
            at, source = max(grace - 2.0, 1.0), "PREEMPTIBLE_GRACE_PERIOD minus 2 s"
    if grace is not None and grace > wait:
        problems.append(
            f"PREEMPTIBLE_GRACE_PERIOD={grace:g} s is longer than KillWait: the trainer plans "
            "its last checkpoint for a window SLURM cuts short"
        )
        fixes.append(f"set PREEMPTIBLE_GRACE_PERIOD={wait:g} or unset it")
    detail = (
        f"SLURM SIGKILLs every process of the job KillWait={wait:g} s after its own SIGTERM "
        f"(scancel, time limit, preemption){note}; preemptible run escalates to SIGKILL "
        f"{at:g} s after that SIGTERM ({source})"
    )
    return detail, problems, fixes
