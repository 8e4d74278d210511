"""``preemptible doctor``: what would happen here on a preemption, and what to change.

Each check reports what it found, and a check that cannot find out (a hung or missing
``scontrol``, an unreachable metadata server, a bad environment value) says so in a WARN line:
the doctor is what people run when something is already wrong, so it must never hang or end
in a traceback.

Here: every check but SLURM's and the checkpoint location's, and ``diagnose`` running them in
order; the SLURM checks are ``_slurm``'s, the checkpoint location's (a bucket's reachability and
credentials) ``_bucket``'s, the ``Check`` line ``_check``'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

from .._env import env_float, env_str
from .._errors import ConfigError
from .._run import current_run
from ..stop._latch import DEFAULT_SIGNALS
from ..stop._launcher import SHELLS, unforwarding_parent
from ..stop._signals import KEEP_IGNORED
from ._bucket import NAME as LOCATION
from ._bucket import check_location
from ._check import INFO, OK, WARN, Check
from ._slurm import _read_slurm, _Slurm, _slurm_end, _slurm_job, _slurm_kill


def _platform() -> tuple[Check, str]:
    from ..notices import detect

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


def _notices(platform: str, slurm: _Slurm | None) -> list[Check]:
    from ..notices import KUBERNETES_DEFAULT_GRACE, grace_period_from_env, sources_for
    from ..notices._sources import EC2, GCE, Azure, SlurmTimeLimit, StopFile

    checks = []
    for source in sources_for(platform):
        if isinstance(source, GCE | EC2 | Azure):
            where = source.display  # never the credentials of an endpoint URL
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
            checks.append(_slurm_end(slurm, source.lead))
        elif isinstance(source, StopFile):
            checks.append(
                Check(
                    "notices (stop file)",
                    OK,
                    f"touch {source.path} to stop the run at the next step",
                )
            )
    if platform == "kubernetes":
        try:
            window = grace_period_from_env()
            problem = ""
        except ConfigError as exc:
            window, problem = None, f"{exc}; "
        later = f"{window:g}" if window is not None else f"an assumed {KUBERNETES_DEFAULT_GRACE:g}"
        checks.append(
            Check(
                "notices (kubernetes)",
                OK if window is not None else WARN,
                f"{problem}SIGTERM, then SIGKILL {later} s later (terminationGracePeriodSeconds)",
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


def _signals() -> list[Check]:
    """What each stop signal would do to a run started from here.

    The doctor inherits what the run would inherit from the same shell: ignored signals
    (``nohup``, ``trap '' TERM``) and the blocked-signal mask survive exec; handlers do not.
    """
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    checks, fine = [], []
    for sig in DEFAULT_SIGNALS:
        name = sig.name[3:]
        if sig in blocked:
            checks.append(
                Check(
                    f"signal {name}",
                    WARN,
                    f"{name} is blocked in this process (inherited signal mask): it stays "
                    "pending and never reaches preemptible's handler, so it cannot stop the run",
                    "start the run from a launcher that does not block signals (check its "
                    "sigprocmask/SigBlk in /proc/<pid>/status)",
                )
            )
        elif signal.getsignal(sig) == signal.SIG_IGN and sig == signal.SIGHUP:
            checks.append(
                Check(
                    "signal HUP",
                    INFO,
                    "HUP ignored (nohup): a hang-up will not stop the run",
                )
            )
        elif signal.getsignal(sig) == signal.SIG_IGN and sig in KEEP_IGNORED:
            checks.append(
                Check(
                    f"signal {name}",
                    WARN,
                    f"{name} is ignored since this process started (a background job `cmd &` "
                    f"of a script, or trap '' {name}); preemptible keeps it ignored, so "
                    f"{name} (Ctrl+C) will not stop the run",
                    f"start the run in the foreground, or stop it with SIGTERM; "
                    f"or trap - {name} before starting it",
                )
            )
        elif signal.getsignal(sig) == signal.SIG_IGN:
            checks.append(
                Check(
                    f"signal {name}",
                    WARN,
                    f"{name} is ignored since this process started (trap '' {name} in a "
                    f"shell, or a launcher); preemptible installs its handler over it, so "
                    f"{name} still stops a run that creates the handler, but every other "
                    f"process started from here ignores {name}",
                    f"trap - {name} before starting the run, or find the launcher that ignores it",
                )
            )
        else:
            fine.append(name)
    if fine:
        checks.insert(
            0,
            Check(
                "signals",
                OK,
                f"{', '.join(fine)}: the first finishes the step, saves and exits 128+signum; "
                "the second exits 1 at once. Handled in the process (main thread) that creates "
                "the handler; forked DataLoader workers ignore them and survive a "
                "process-group SIGTERM",
                "create PreemptionCheckpointHandler in the main thread",
            ),
        )
    return checks


def _pid1() -> Check:
    try:
        comm = Path("/proc/1/comm").read_text().strip()
    except OSError:
        return Check("pid 1", INFO, "cannot read /proc/1/comm")
    container = Path("/.dockerenv").exists() or bool(env_str("KUBERNETES_SERVICE_HOST"))
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


def _launcher() -> Check:
    """Whether a stop signal reaches training through the launcher (``stop/_launcher.py``)."""
    if current_run().run_id:
        return Check(
            "launcher",
            OK,
            "under preemptible run: a stop signal reaches the job's whole process group, "
            "whatever launcher the job uses",
        )
    fix = "run the program under `preemptible run -- ...` (e.g. preemptible run -- accelerate "
    fix += "launch train.py), which signals the whole process group"
    found = unforwarding_parent(supervised=False)
    if found is not None:
        return Check(
            "launcher", WARN, f"started by {found.name} (pid {found.pid}): {found.why}", fix
        )
    return Check(
        "launcher",
        INFO,
        "torchrun, srun and accelerate launch --multi_gpu pass a stop signal on to training; "
        "accelerate launch without --multi_gpu (also --cpu --num_processes N) and a shell "
        "running the program among other commands do not",
        fix.replace("run the program", "with those, run the program", 1),
    )


def _nccl() -> Check | None:
    distributed = any(env_str(v) for v in ("WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS"))
    if not distributed and shutil.which("nvidia-smi") is None:
        return None
    return Check(
        "nccl",
        WARN,
        "NCCL and some MPI stacks install their own SIGUSR1 handler in every rank; a USR1 from "
        "SLURM may then never reach preemptible",
        "use --signal=B:USR2@120 (preemptible handles USR2 as well) for distributed jobs",
    )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """term_timeout() logs what it ignores; the doctor says it in a WARN line instead."""
    log = logging.getLogger("preemptible")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _term_timeout(platform: str, slurm: _Slurm | None) -> Check:
    from ..notices import KUBERNETES_DEFAULT_GRACE, grace_period_from_env
    from ..supervisor import term_timeout

    problems, fixes = [], []
    try:
        explicit = env_float("PREEMPTIBLE_TERM_TIMEOUT")
    except ConfigError as exc:
        explicit = None
        problems.append(f"{exc} (preemptible run refuses it)")
        fixes.append("fix or unset PREEMPTIBLE_TERM_TIMEOUT")
    try:
        grace = grace_period_from_env()
    except ConfigError as exc:
        grace = None
        problems.append(f"{exc} (preemptible run refuses it)")
        fixes.append("fix or unset PREEMPTIBLE_GRACE_PERIOD")
    with _quiet():
        seconds, source = term_timeout(explicit)
    now = f"SIGKILL the job {seconds:.0f} s after the first stop signal ({source})"
    if slurm is not None and slurm.info:
        detail, more, more_fixes = _slurm_kill(slurm, explicit, grace)
        detail += (
            ". On a signal now that SLURM does not follow with a kill (a --signal warning, "
            f"scancel --signal) it would {now}"
        )
        problems += more
        fixes += more_fixes
    elif slurm is not None:
        detail = f"SLURM's kill deadline is unknown ({slurm.error}); preemptible run would {now}"
        problems.append("SLURM's SIGKILL may come before preemptible run's")
        fixes.append("check that slurmctld answers (scontrol ping)")
    else:
        detail = f"preemptible run would {now}"
    if platform == "kubernetes":
        window = grace if grace is not None else KUBERNETES_DEFAULT_GRACE
        if seconds > window:
            assumed = "" if grace is not None else " (assumed; the default)"
            problems.append(
                f"Kubernetes SIGKILLs the pod {window:g} s after SIGTERM{assumed}, before that"
            )
            fixes.append("set PREEMPTIBLE_GRACE_PERIOD to terminationGracePeriodSeconds")
        elif grace is None:
            problems.append(
                f"Kubernetes SIGKILLs the pod {window:g} s after SIGTERM (assumed; the default "
                "terminationGracePeriodSeconds): right only if the pod keeps that default"
            )
            fixes.append("set PREEMPTIBLE_GRACE_PERIOD to terminationGracePeriodSeconds")
    if problems:
        return Check("term-timeout", WARN, f"{'; '.join(problems)}. {detail}", "; ".join(fixes))
    return Check(
        "term-timeout",
        OK,
        detail,
        "set --term-timeout or PREEMPTIBLE_GRACE_PERIOD to the platform's window",
    )


def _outcome(platform: str) -> Check:
    from ..notices import default_config

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


def _containment() -> Check:
    """How `preemptible run` would keep every process of an attempt from outliving it."""
    from ..supervisor._cgroup import ENV, choose

    try:
        found = choose()
    except ConfigError as exc:
        return Check("containment", WARN, str(exc), f"set {ENV}=auto (or unset it)")
    if found.kind == "cgroup":
        return Check(
            "containment",
            OK,
            f"cgroup v2: each attempt of preemptible run gets a cgroup of its own under "
            f"{found.parent}; whatever it starts, in any session or process group (torchrun's "
            "workers), is killed with cgroup.kill when the attempt ends or its supervisor dies",
        )
    return Check(
        "containment",
        OK,
        f"/proc guardian ({found.why}). A guardian tracks every process of an "
        "attempt through /proc (every 50 ms, pid and start time) and kills them all if the "
        "supervisor dies; only a process that clears its environment and leaves its parent "
        "within 50 ms of its start could escape",
        "for a cgroup per attempt run as root, or in a delegated cgroup: "
        "systemd-run --user --scope -p Delegate=yes preemptible run ...",
    )


def _run(name: str, check: Callable[[], Check | list[Check] | None]) -> list[Check]:
    """One check; whatever goes wrong inside it becomes its WARN line."""
    try:
        found = check()
    except ConfigError as exc:
        return [Check(name, WARN, str(exc))]
    except Exception as exc:
        return [
            Check(
                name,
                WARN,
                f"this check failed: {type(exc).__name__}: {exc}",
                "a bug in preemptible doctor; please report it with this line",
            )
        ]
    if found is None:
        return []
    return found if isinstance(found, list) else [found]


def diagnose(checkpoint_dir: str | None = None) -> list[Check]:
    """Every check, in order; ``checkpoint_dir`` (a directory or a checkpoint URL) adds the
    check of that location (``_bucket``)."""
    try:
        platform_check, platform = _platform()
    except Exception as exc:
        failed = f"this check failed: {type(exc).__name__}: {exc}"
        platform_check, platform = Check("platform", WARN, failed), "local"
    try:
        slurm = _read_slurm()
        bad_job: Check | None = None
    except ConfigError as exc:
        slurm, bad_job = None, Check("slurm", WARN, str(exc), "run inside a real SLURM job")
    return [
        platform_check,
        *_run("notices", lambda: _notices(platform, slurm)),
        *_run("signals", _signals),
        *_run("pid 1", _pid1),
        *_run("launcher", _launcher),
        *([bad_job] if bad_job else _run("slurm", lambda: _slurm_job(slurm))),
        *_run("nccl", _nccl),
        *_run("term-timeout", lambda: _term_timeout(platform, slurm)),
        *_run("containment", _containment),
        *_run("on preemption", lambda: _outcome(platform)),
        *_run("save interval", lambda: _save_interval(platform)),
        *_run(LOCATION, lambda: check_location(checkpoint_dir)),
    ]


def _save_interval(platform: str) -> Check:
    from ..checkpoint._interval import SaveInterval

    try:
        chosen = SaveInterval(platform=platform).describe()
    except ConfigError as exc:
        return Check("save interval", WARN, str(exc), "fix the value, or unset it")
    return Check(
        "save interval",
        INFO,
        f"with save_every_steps='auto': {chosen} (the real save cost is measured at run time)",
        "set PREEMPTIBLE_MTBF (seconds) if you know how often runs here are interrupted",
    )
