"""``preemptible doctor``: what would happen here on a preemption, and what to change."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ._errors import ConfigError
from ._signals import DEFAULT_SIGNALS

OK, WARN, INFO = "ok", "warn", "info"
SHELLS = {"sh", "bash", "dash", "zsh", "ash", "ksh"}


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def _platform() -> tuple[Check, str]:
    from .notices import detect

    try:
        found = detect()
    except ConfigError as exc:
        return Check(
            "platform", WARN, str(exc), "unset PREEMPTIBLE_PLATFORM or fix its value"
        ), "local"
    return (
        Check(
            "platform",
            OK,
            f"{found.platform} ({found.reason})",
            "set PREEMPTIBLE_PLATFORM=slurm|gce|ec2|azure|kubernetes|local if this is wrong",
        ),
        found.platform,
    )


def _notices(platform: str) -> list[Check]:
    from .notices import sources_for
    from .notices._sources import EC2, GCE, Azure, SlurmTimeLimit, StopFile

    checks = []
    for source in sources_for(platform):
        if isinstance(source, GCE | EC2 | Azure):
            where = source.base if isinstance(source, GCE | EC2) else source.url
            try:
                source.timeout = 1.0
                notice = source.poll()
                state = "a notice is pending now!" if notice else "reachable, no notice pending"
                checks.append(
                    Check(
                        f"notices ({source.name})",
                        WARN if notice else OK,
                        f"{where}: {state}; polled every second from a background thread",
                    )
                )
            except Exception as exc:
                checks.append(
                    Check(
                        f"notices ({source.name})",
                        WARN,
                        f"{where} did not answer ({exc})",
                        "check that the metadata server is reachable from here (firewall, pod "
                        "network policy, IMDS hop limit); without it only signals stop the run",
                    )
                )
        elif isinstance(source, SlurmTimeLimit):
            try:
                end = source.end_time()
                detail = (
                    f"job {source.job_id} ends at its time limit in "
                    f"{end - time.time():.0f} s; notice {source.lead:.0f} s "
                    "before"
                    if end
                    else f"job {source.job_id} has no time limit"
                )
                checks.append(Check("notices (slurm)", OK, detail))
            except Exception as exc:
                checks.append(
                    Check(
                        "notices (slurm)",
                        WARN,
                        f"cannot read the job's end time: {exc}",
                        "put SLURM's scontrol on PATH",
                    )
                )
        elif isinstance(source, StopFile):
            checks.append(
                Check(
                    "notices (stop file)",
                    OK,
                    f"touch {source.path} to stop the run at the next step",
                )
            )
    if platform == "kubernetes":
        window = os.environ.get("PREEMPTIBLE_GRACE_PERIOD")
        checks.append(
            Check(
                "notices (kubernetes)",
                OK if window else WARN,
                f"SIGTERM, then SIGKILL {window or 'an assumed 30'} s later "
                "(terminationGracePeriodSeconds)",
                "set PREEMPTIBLE_GRACE_PERIOD in the pod's env to terminationGracePeriodSeconds",
            )
        )
    if not checks:
        checks.append(
            Check(
                "notices",
                INFO,
                "no platform notices here; signals only",
                "set PREEMPTIBLE_STOP_FILE to stop runs by touching a file",
            )
        )
    return checks


def _signals() -> Check:
    names = ", ".join(s.name for s in DEFAULT_SIGNALS)
    return Check(
        "signals",
        OK,
        f"{names}: the first finishes the step, saves and exits 128+signum; the second exits 1 "
        "at once. Handled in the process (main thread) that creates the handler; forked "
        "DataLoader workers ignore them and survive a process-group SIGTERM",
        "create PreemptionCheckpointHandler in the main thread",
    )


def _pid1() -> Check:
    try:
        comm = Path("/proc/1/comm").read_text().strip()
    except OSError:
        return Check("pid 1", INFO, "cannot read /proc/1/comm")
    container = Path("/.dockerenv").exists() or bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    if not container:
        with contextlib.suppress(OSError):
            cgroup = Path("/proc/1/cgroup").read_text()
            container = any(k in cgroup for k in ("kubepods", "docker", "containerd"))
    if os.getpid() == 1:
        return Check(
            "pid 1",
            OK,
            "this process is PID 1: the kernel drops signals that it does "
            "not handle; preemptible installs handlers, so INT/TERM/USR1/USR2 work",
        )
    if container and comm in SHELLS:
        return Check(
            "pid 1",
            WARN,
            f"PID 1 of this container is a shell ({comm}); a shell as "
            "PID 1 does not pass SIGTERM on, so training never hears of the stop",
            'start with exec (CMD ["preemptible", "run", "--", ...]) or use tini as init',
        )
    return Check("pid 1", OK, f"PID 1 is {comm}" + (" (in a container)" if container else ""))


def _slurm() -> list[Check]:
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return []
    checks = []
    if shutil.which("scontrol") is None:
        checks.append(
            Check(
                "slurm",
                WARN,
                f"job {job}, but scontrol is not on PATH: a preempted run cannot be requeued",
                "put SLURM's client tools on PATH",
            )
        )
        return checks
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=10
    ).stdout
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    requeue = fields.get("Requeue") == "1"
    checks.append(
        Check(
            "slurm",
            OK if requeue else WARN,
            f"job {job}: Requeue={fields.get('Requeue', '?')}, "
            f"TimeLimit={fields.get('TimeLimit', '?')}",
            "" if requeue else "submit with sbatch --requeue so preemptible run can requeue it",
        )
    )
    checks.append(
        Check(
            "slurm signal",
            INFO,
            "SLURM does not show whether the job was submitted with --signal; without it the "
            "first warning is the SIGTERM at the time limit (preemptible also watches the job's "
            "end time)",
            "submit with --signal=B:USR1@120 and exec preemptible run in the batch script",
        )
    )
    return checks


def _nccl() -> Check | None:
    distributed = any(os.environ.get(v) for v in ("WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS"))
    if not distributed and shutil.which("nvidia-smi") is None:
        return None
    return Check(
        "nccl",
        WARN,
        "NCCL and some MPI stacks install their own SIGUSR1 handler in every rank; a USR1 from "
        "SLURM may then never reach preemptible",
        "use --signal=B:USR2@120 (preemptible handles USR2 as well) for distributed jobs",
    )


def _term_timeout() -> Check:
    from .supervisor import term_timeout

    seconds, source = term_timeout()
    return Check(
        "term-timeout",
        OK,
        f"preemptible run would SIGKILL the job {seconds:.0f} s "
        f"after the first stop signal ({source})",
        "set --term-timeout or PREEMPTIBLE_GRACE_PERIOD to the platform's window",
    )


def _outcome(platform: str) -> Check:
    from .notices import default_config

    try:
        config = default_config(platform)
    except ConfigError as exc:
        return Check("on preemption", WARN, str(exc))
    if config.grace_period is not None:
        what = (
            f"a {config.grace_period:.0f} s window after SIGTERM: an insurance checkpoint at "
            "once, training goes on, the final checkpoint at the last safe moment"
        )
    elif config.termination_watcher_fn is not None:
        what = (
            "a platform notice gives a deadline: an insurance checkpoint at once, training "
            "goes on, the final checkpoint at the last safe moment"
        )
    else:
        what = "the next step boundary: finish the step, commit a checkpoint"
    return Check(
        "on preemption",
        INFO,
        f"{what}; exit 128+signum (143 for a notice); "
        "preemptible run marks the attempt PREEMPTED and restarts or requeues it",
    )


def diagnose() -> list[Check]:
    platform_check, platform = _platform()
    checks = [platform_check, *_notices(platform), _signals(), _pid1(), *_slurm()]
    nccl = _nccl()
    if nccl is not None:
        checks.append(nccl)
    checks += [_term_timeout(), _outcome(platform)]
    return checks
