"""When a supervisor escalates: the term timeout from the first stop signal to SIGKILL (from
``--term-timeout``, SLURM's KillWait, PREEMPTIBLE_GRACE_PERIOD or Kubernetes' grace), what is
due to an attempt's group when (``Escalation``), and what an attempt is told of it when it
starts (``kill_after``)."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from .._env import env_str
from .._errors import ConfigError, SlurmError
from ..notices import KUBERNETES_DEFAULT_GRACE as KUBERNETES_GRACE
from ..notices import grace_period_from_env
from ..stop._signals import signal_name
from . import _slurm
from ._journal import Received
from ._process import ProcessGroup

logger = logging.getLogger("preemptible")

DEFAULT_TERM_TIMEOUT = 60.0


@dataclass
class Escalation:
    """What the supervisor does to an attempt's group, and when (monotonic times)."""

    kill_at: float | None = None  # SIGKILL, a term timeout after the first stop signal
    timeout: float = 0.0
    leader_gone: float | None = None  # when the job's main process was seen to exit
    linger: list[tuple[float, int]] = field(default_factory=list)  # (when, signal)
    killed: bool = False  # every process of the attempt was SIGKILLed

    def next_at(self) -> float:
        return min([self.kill_at or math.inf, *(t for t, _ in self.linger)])


def escalate(
    plan: Escalation,
    group: ProcessGroup,
    mine: list[Received],
    now: float,
    *,
    term_timeout: Callable[[], tuple[float, str]],
    linger: float,
) -> None:
    """The supervisor module docstring's rules: SIGKILL a term timeout after a stop; TERM, then KILL
    what the main process left in its group when no stop was passed on."""
    if not plan.killed and any(s.signum == signal.SIGKILL for s in mine):
        # stop_job's SIGKILL (a lost lease, cancel --now) went to the group from another
        # thread; here, in the main loop, it reaches the processes outside it too
        plan.killed = True
        group.kill_all()
    if mine and plan.kill_at is None:
        plan.timeout, source = term_timeout()
        plan.kill_at = now + plan.timeout
        logger.info(
            "preemptible: %s %s the job; SIGKILL in %.0f s if it has not exited (%s)",
            signal_name(mine[0].signum),
            "passed on to" if mine[0].forwarded else "received; not passed to",
            plan.timeout,
            source,
        )
    if plan.kill_at is not None and now >= plan.kill_at:
        logger.error(
            "preemptible: the job is still running %.0f s after the stop signal; "
            "sending SIGKILL to all of its processes (a stopped attempt: PREEMPTED, the next "
            "one resumes from the newest checkpoint)",
            plan.timeout,
        )
        group.kill_all()
        plan.killed = True
        plan.kill_at = math.inf
    if any(s.forwarded for s in mine):
        plan.linger.clear()  # a stop is under way: the group gets the term timeout
        return
    if group.ending is not None and plan.leader_gone is None:
        plan.leader_gone = now
        wait = linger
        plan.linger = [(now + wait, signal.SIGTERM), (now + 2 * wait, signal.SIGKILL)]
    while plan.linger and now >= plan.linger[0][0]:
        sig = plan.linger.pop(0)[1]
        logger.warning(
            "preemptible: the job's main process ended (%s) but processes it started in "
            "its group are still running %.0f s later; sending them %s",
            group.ending.describe() if group.ending else "?",
            now - (plan.leader_gone or now),
            signal_name(sig),
        )
        group.signal(sig)


def term_timeout(explicit: float | None = None) -> tuple[float, str]:
    """Seconds from the first stop signal to SIGKILL, and where the number came from.

    Under SLURM the deadline is SLURM's own: it SIGKILLs every process of the job KillWait
    after its SIGTERM whatever this says, and a supervisor killed first cannot record the
    attempt or requeue. So escalate ``_slurm.MARGIN`` before that; an explicit value still
    wins, with a warning when SLURM's KILL will come first.
    """
    slurm = _slurm.kill_deadline()
    if slurm is not None and not slurm.near:
        slurm = None  # SLURM is not ending the job: this stop is not bounded by it
    if explicit is not None:
        if slurm is not None and explicit > slurm.seconds:
            logger.warning(
                "preemptible: --term-timeout %g s is longer than SLURM allows here (%s); "
                "SLURM's SIGKILL will come first, and the attempt is neither recorded nor "
                "requeued. Use --term-timeout %g or less.",
                explicit,
                slurm.why,
                _slurm.before_kill(slurm.seconds),
            )
        return explicit, "--term-timeout"
    choices: list[tuple[float, str]] = []
    try:
        grace = grace_period_from_env()
    except ConfigError as exc:  # a supervisor refused it at its start; the doctor asks anyway
        logger.warning("preemptible: ignoring it: %s", exc)
        grace = None
    if grace is not None:
        choices.append((max(grace - 2.0, 1.0), "PREEMPTIBLE_GRACE_PERIOD minus 2 s"))
    if slurm is not None:
        if grace is not None and grace > slurm.seconds:
            logger.warning(
                "preemptible: PREEMPTIBLE_GRACE_PERIOD=%g s is longer than SLURM allows here "
                "(%s); the shorter one is used",
                grace,
                slurm.why,
            )
        before = f"{_slurm.MARGIN:g} s before {slurm.why}"
        choices.append((_slurm.before_kill(slurm.seconds), before))
    if choices:
        return min(choices)
    if env_str("KUBERNETES_SERVICE_HOST"):
        # the kubelet SIGKILLs terminationGracePeriodSeconds (default 30 s) after its SIGTERM
        return (
            KUBERNETES_GRACE - 2.0,
            "Kubernetes' default grace of 30 s minus 2 s; set PREEMPTIBLE_GRACE_PERIOD to "
            "terminationGracePeriodSeconds",
        )
    return DEFAULT_TERM_TIMEOUT, "the default; set --term-timeout"


def kill_after(explicit: float | None = None) -> float:
    """What an attempt starting now is told of the term timeout (``PREEMPTIBLE_KILL_AFTER``):
    the seconds it can count on between a stop passed on to it and the SIGKILL, for the waits
    of a stop with no deadline of its own (an upload's). The term timeout is decided at the
    stop, and under SLURM (nothing explicit) it may then be shorter than now, SLURM's KillWait
    less the margin once SLURM ends the job: the attempt is told the shorter, as a wait that
    ends a little early costs less than a job killed in the middle of it."""
    seconds, _source = term_timeout(explicit)
    if explicit is None and _slurm.job_id() is not None:
        with contextlib.suppress(SlurmError):  # term_timeout warned; its answer stands
            seconds = min(seconds, _slurm.before_kill(_slurm.kill_wait()))
    return seconds
