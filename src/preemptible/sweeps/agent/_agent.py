"""``preemptible agent``: take runs of a sweep from the queue and run each one to its end.

Each claimed run is one attempt of ``preemptible run``'s machinery (``Supervisor.run_attempt``):
the same process group, signal forwarding, escalation, subreaper, guardian, run record and
classification, so an agent and ``preemptible run`` can never disagree about how an attempt
ended. What the agent adds is the queue:

- a heartbeat thread renews the run's lease (on its own database connection; another thread
  copies the metrics the run reported, ``preemptible.report``, into the queue, and the lease
  never waits on it: ``_holding``), passes on the run's latest values, marks the run preempting
  when the run did, and passes a sweep's ``cancel`` on to the run (SIGTERM, then SIGKILL after
  the term timeout; ``--now``: SIGKILL);
- the lease's end, by this host's monotonic clock, goes to the run in ``lease.json``
  (``PREEMPTIBLE_LEASE_FILE``) at every renewal. When renewals stop, the run is told to stop
  ``warn`` seconds before the lease's own deadline (``LEASE_MARGIN`` of the lease before it
  ends) and must be gone by then: the run watches the file itself (a notice, as for a spot
  VM's), and the attempt's guardian, a process of its own that runs on while this agent is
  stopped (SIGSTOP, Ctrl+Z, a frozen VM), sends SIGTERM at the warning and SIGKILL at the
  deadline to every process of the attempt, whether its program watches the lease or not (a
  plain script does not: ``supervisor/_guard.py``, ``Fence``); a watchdog thread here does it
  where there is no guardian. Only ``LEASE_MARGIN`` after the lease's end may an agent on
  another host take the run over, so two attempts never run at once, and an agent never takes
  a process it cannot see (another pid namespace or host) for gone;
- when the attempt ends, ``finish`` records it and the queue decides the run's next state
  (PREEMPTED runs go back to the queue with the same id and checkpoint directory, and the next
  agent resumes them). A result that comes after the lease ran out is kept when no other
  attempt started; otherwise it goes on its own attempt only, marked late (the run is the new
  attempt's, and resumes from its checkpoints);
- a run whose previous attempt may still be alive on this host (its agent is stopped, or a
  process still holds its locks) is left in the queue until it is not: waiting is not a
  failure (``HostView``);
- a run that cannot start here (no such program, an unset ``${envvar:NAME}``, a home that
  cannot be written) is handed back untouched, with no attempt counted, and said once; after
  ``max_consecutive_failures`` runs in a row that could not start or failed within
  ``QUICK_FAILURE`` seconds, the agent backs off between them and then exits with one line
  instead of burning the queue (exit 2 when they could not start, 1 when they failed).

Stopping an agent (SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2): the signal goes to the run,
which saves and exits; the agent records the attempt (the run goes back to the queue) and exits
128 + signum without claiming again. Wherever the stop lands, the attempt is PREEMPTED: a
program stopped in its start-up (before its handler exists), after its loop, or one without a
handler dies by the signal, and the supervisor knows it passed that stop on
(``supervisor/_classify.py``); the run goes back to the queue, not to its failure budget.
Between runs it exits at once. A second signal reaches the run as a second signal: it exits
at once, as under ``preemptible run``.

Agents on several machines share the checkpoints of a preempted run, which whichever agent
takes it next resumes: either in a bucket (``--checkpoint-dir s3://bucket/prefix``: each run's
under ``<url>/<run id>``, and the agents share no disk at all), or in a directory of runs
(``--home``) that every machine mounts.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from ..._errors import (
    ConfigError,
    LeaseLost,
    PreemptibleError,
    RunLockedError,
)
from ..._paths import RunPaths
from ..._report import read_summary
from ..._run import read_record
from ..._states import Control, Ending, QueueState
from ...checkpoint._location import local_or_url
from ...notices._lease import LEASE_FILE_ENV
from ...stop._signals import STOP_SIGNALS, install_handlers, restore_handlers
from ...stop._termination import signal_exit_code
from ...supervisor._record import load_record
from ..spec._command import build_command
from ..spec._model import SweepSpec
from ..spec._sample import Observation, propose
from ..spec._spec import parse_spec
from ..store._local import HostView
from ..store._pause import CtrlZ
from ..store._queue import open_store
from ..store._rows import Claim
from ._attempt_files import _describe, _mkdirs, _remove, _write_ending
from ._early import Judge, early_ending, judge_for
from ._holding import MIN_LEASE_HEARTBEATS, WARN_AFTER_HEARTBEATS, RunLease
from ._holding import newest_step as _newest_step

logger = logging.getLogger("preemptible")

# what an agent takes as a stop: the signals the supervisor passes on to a run
DEFAULT_HEARTBEAT = 10.0
DEFAULT_LEASE = 60.0
DEFAULT_MAX_CONSECUTIVE_FAILURES = 5  # as W&B's agent
QUICK_FAILURE = 10.0  # seconds: a run that failed sooner counts toward the crash loop
MAX_BACKOFF = 60.0  # seconds between two runs in a crash loop, at most
EXIT_CANNOT_START = 2
EXIT_CRASH_LOOP = 1


@dataclass(frozen=True)
class AgentConfig:
    sweep_id: str
    db: str | None = None
    count: int | None = None
    heartbeat: float = DEFAULT_HEARTBEAT
    lease: float = DEFAULT_LEASE
    home: Path = field(default_factory=lambda: Path(".preemptible"))
    max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES
    # each run's checkpoints under <checkpoint_dir>/<run id>: a bucket's URL (a str) or a
    # directory; None: the run's directory under --home
    checkpoint_dir: Path | str | None = None

    def __post_init__(self) -> None:
        if self.count is not None and (isinstance(self.count, bool) or self.count < 1):
            raise ConfigError(f"--count {self.count!r} is not valid; use an integer >= 1")
        if not (0 < self.heartbeat < float("inf")):
            raise ConfigError(f"--heartbeat {self.heartbeat!r} is not valid; use seconds > 0")
        if not (MIN_LEASE_HEARTBEATS * self.heartbeat <= self.lease < float("inf")):
            raise ConfigError(
                f"--lease {self.lease:g} is not valid; use at least {MIN_LEASE_HEARTBEATS:g} "
                f"times --heartbeat ({MIN_LEASE_HEARTBEATS * self.heartbeat:g} s): a run is "
                f"stopped once {WARN_AFTER_HEARTBEATS:g} renewals in a row are missing"
            )
        if isinstance(self.checkpoint_dir, str):  # a bad URL: one line, before any claim
            object.__setattr__(self, "checkpoint_dir", local_or_url(self.checkpoint_dir))
        n = self.max_consecutive_failures
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(
                f"--max-consecutive-failures {n!r} is not valid; use an integer >= 0 (0: never "
                "stop)"
            )


def run_checkpoints(config: AgentConfig, run_id: str) -> Path | str | None:
    """Where a run's checkpoints go: ``<--checkpoint-dir>/<run id>`` (a bucket's URL or a
    directory), or None (the run's own directory under --home)."""
    where = config.checkpoint_dir
    if isinstance(where, str):
        return f"{where.rstrip('/')}/{run_id}"
    return None if where is None else where / run_id


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.host = socket.gethostname()
        self.id = f"{os.getpid()}-{secrets.token_hex(4)}"  # shown as agent@host
        self.local = HostView(config.home)
        self.store = open_store(config.db, create=False)
        self.sweep = self.store.sweep(config.sweep_id)  # an unknown sweep fails here: one line
        self.spec: SweepSpec = parse_spec(self.sweep.spec, source=f"sweep {self.sweep.id}")
        self.done = 0
        self._signals: list[int] = []
        self._previous: dict[int, Any] = {}
        self._supervisor: Any = None
        self._handing: Any = None  # the Supervisor whose attempt is starting (``_on_signal``)
        self._streak = 0  # runs in a row that could not start or failed within seconds
        self._said: set[str] = set()  # start failures already logged

    # -- signals between runs ----------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)  # bookkeeping only; the loop looks at it
        supervisor = self._handing
        if supervisor is not None:  # its attempt is starting: the stop is the attempt's too
            supervisor.receive(signum)

    def _install(self) -> None:
        # nohup: the hang-up stays ignored
        self._previous.update(install_handlers(STOP_SIGNALS, self._on_signal)[0])

    def _restore(self) -> None:
        restore_handlers(self._previous)
        self._previous.clear()

    def _wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._signals and time.monotonic() < deadline:
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        self._install()
        ctrl_z = CtrlZ()  # stopped from the terminal, it stops between transactions
        ctrl_z.install()
        try:
            return self._loop()
        finally:
            ctrl_z.restore()
            self._restore()
            self.store.close()

    def _loop(self) -> int:
        logger.info(
            "preemptible: agent %s on sweep %s (%s)", self.id, self.sweep.id, self.store.display
        )
        while True:
            if self._signals:
                return self._stopped(self._signals[0])
            if self.config.count is not None and self.done >= self.config.count:
                logger.info("preemptible: agent ran %d run(s) (--count); exiting", self.done)
                return 0
            claim = self.store.claim(
                self.sweep.id,
                agent=self.id,
                host=self.host,
                lease=self.config.lease,
                propose=self._propose,
                local=self.local,
            )
            if claim is None:
                if self._nothing_left():
                    return 0
                self._wait(self.config.heartbeat)
                continue
            code = self._run(claim)
            if code is not None:
                return code

    def _propose(self, history: list[Observation], index: int) -> dict[str, Any] | None:
        return propose(self.spec, history, index=index, seed=self.sweep.seed)

    def _stopped(self, signum: int) -> int:
        logger.warning(
            "preemptible: agent stopped by %s; no more runs claimed", signal.Signals(signum).name
        )
        return signal_exit_code(signum)

    def _nothing_left(self) -> bool:
        """Whether this agent is done: the sweep is stopped or cancelled, or it has nothing
        pending or running. While another agent's run may still come back, it waits."""
        sweep = self.store.sweep(self.sweep.id)
        if sweep.control in (Control.STOPPED, Control.CANCELLED):
            logger.info("preemptible: sweep %s is %s; agent exits", sweep.id, sweep.control)
            return True
        if sweep.control == Control.PAUSED:
            return False
        reached = self.store.target_reached(sweep.id)
        # once the target is reached, runs that never ran are not started (``_claims``)
        runs = [r for r in self.store.runs(sweep.id) if reached is None or r.attempt > 0]
        if {r.state for r in runs} & {QueueState.PENDING, QueueState.RUNNING}:
            return False
        if reached is not None:
            logger.info(
                "preemptible: sweep %s reached its metric.target (run %s: %g); agent exits",
                sweep.id,
                *reached,
            )
            return True
        logger.info("preemptible: sweep %s has nothing left to run; agent exits", sweep.id)
        return True

    # -- one run -----------------------------------------------------------------------------
    def _run(self, claim: Claim) -> int | None:
        """One attempt of ``claim``; the agent's exit code when it must stop, else None."""
        from ...supervisor import Supervisor, SupervisorConfig
        from ...supervisor._runid import check_run_id

        try:  # before anything is made from it: the id names a directory under --home
            check_run_id(claim.run_id, "the sweep database")
        except ConfigError as exc:
            logger.error("preemptible: %s; the run cannot run on any agent", exc)
            self._finish_unstartable(claim)
            return None
        run = RunPaths.under(self.config.home, claim.run_id)
        attempt_dir = run.attempt(claim.attempt)
        lease_file = run.lease(claim.attempt)
        logger.info(
            "preemptible: run %s (#%d) attempt %d: %s",
            claim.run_id,
            claim.index,
            claim.attempt,
            _describe(claim.params),
        )
        renewed_at = self.store.last_try_at  # the claim's lease began after this
        made: list[Path] = []
        try:
            command = build_command(
                self.spec,
                claim.params,
                interpreter=sys.executable,
                params_file=run.params,
            )
            supervisor = Supervisor(
                SupervisorConfig(
                    command=command,
                    run_id=claim.run_id,
                    home=self.config.home,
                    term_timeout=self.spec.term_timeout,
                    extra_env={LEASE_FILE_ENV: str(lease_file.absolute())},
                    lease_file=lease_file.absolute(),  # its guardian fences it by the lease
                    checkpoint_dir=run_checkpoints(self.config, claim.run_id),
                    job_control=False,  # Ctrl+Z stops the agent (CtrlZ); the run stops by lease
                )
            )
            made = _mkdirs(attempt_dir)
            beat = RunLease(
                self.config.lease,
                self.config.heartbeat,
                self.store,
                self.id,
                claim,
                supervisor,
                attempt_dir,
                renewed_at,
                judge=self._judge(claim),
            )
            beat.write()
        except (OSError, PreemptibleError) as exc:
            return self._could_not_start(claim, exc, [*made, lease_file])
        # From here a stop this agent receives is the attempt's too (``_on_signal``), until
        # the supervisor's own handlers take over, and again once they are put back: no moment
        # between the claim and the end is left with the default action (death, for SIGTERM).
        self._handing = supervisor
        try:
            if self._signals:  # told to stop between the claim and the start
                _remove([lease_file, *made])
                self.store.abandon(
                    claim.run_id, agent=self.id, attempt=claim.attempt, epoch=claim.epoch
                )
                return self._stopped(self._signals[0])
            if time.monotonic() >= beat.deadline - beat.warn:  # this agent was stopped meanwhile
                _remove([lease_file, *made])
                self._abandon(claim)
                logger.warning(
                    "preemptible: run %s: its lease is nearly over before it could start (was "
                    "this agent stopped?); handed back",
                    claim.run_id,
                )
                return None
            beat.start()
            failed: PreemptibleError | None = None
            try:
                attempt = supervisor.run_attempt(claim.attempt)
            except PreemptibleError as exc:  # it could not start (no such program, a lock held)
                failed = exc
            finally:
                beat.stop()
        finally:
            self._handing = None
        if isinstance(failed, RunLockedError):  # another supervisor holds it (or took it since)
            _remove([lease_file, *made])
            self._abandon(claim)
            if self.local.blocked(claim.run_id) is None:  # says why, once
                self.local.locked(claim.run_id, str(failed).split(";", 1)[0])
            self._wait(self.config.heartbeat)
            return None
        if failed is not None:
            return self._could_not_start(claim, failed, [lease_file, *made])
        self.done += 1
        if beat.gone is not None:
            raise beat.gone  # the database file is gone: nowhere to record anything
        received = [
            s.signum for s in supervisor.signals if not any(s is r for r in supervisor.requested)
        ]
        ending = str(attempt.state)
        expired = beat.stopped_for_lease
        if expired and ending != Ending.FINISHED:
            ending = Ending.PREEMPTED  # stopped for this agent's lease, not for anything it did
        ending = early_ending(ending, beat.early, expired=expired)
        record = read_record(attempt_dir)
        try:
            state = self.store.finish(
                claim.run_id,
                agent=self.id,
                attempt=claim.attempt,
                epoch=claim.epoch,
                ending=ending,
                exit_code=attempt.exit_code,
                duration=attempt.duration,
                checkpoint_step=_newest_step(supervisor.resume_dir, load_record(attempt_dir)),
                summary=read_summary(attempt_dir) or None,
                marked_preempting=bool(record.get("preempting")),
            )
        except LeaseLost:
            logger.error(
                "preemptible: run %s attempt %d ended %s (exit code %s) after another agent "
                "took the run over (its lease had run out): recorded on the attempt as a late "
                "result; the run is the new attempt's",
                claim.run_id,
                claim.attempt,
                ending,
                attempt.exit_code,
            )
        else:
            logger.info(
                "preemptible: run %s attempt %d ended %s; the run is %s",
                claim.run_id,
                claim.attempt,
                ending,
                state,
            )
            if ending != attempt.state:  # for `preemptible runs`, which reads no queue
                _write_ending(run.ending(claim.attempt), ending)
        if received:
            return self._stopped(received[0])
        quick = ending in (Ending.FAILED, Ending.CRASHED) and attempt.duration < QUICK_FAILURE
        if not quick:
            self._streak = 0
            return None
        return self._count_failure(
            f"the last {self._streak + 1} runs failed within {QUICK_FAILURE:g} s each (the "
            f"last: run {claim.run_id}, exit code {attempt.exit_code}; its output is above)",
            EXIT_CRASH_LOOP,
        )

    def _judge(self, claim: Claim) -> Judge | None:
        """Early termination's judge of the run, when its sweep has one (``_early``)."""
        if self.spec.raw.get("early_terminate") is None:
            return None
        exempt = self.store.run(claim.run_id).early_exempt
        return judge_for(self.spec, claim.sweep_id, claim.run_id, exempt=exempt)

    def _could_not_start(self, claim: Claim, exc: BaseException, made: list[Path]) -> int | None:
        """The run cannot start on this agent: its command or this machine, not the run, is
        at fault. Hand it back untouched (no attempt, no budget); say why once."""
        _remove(made)
        self._abandon(claim)
        if isinstance(exc, OSError):
            reason = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
        else:
            reason = str(exc)
        if reason not in self._said:
            self._said.add(reason)
            logger.error(
                "preemptible: run %s could not start: %s; it goes back to the queue, with no "
                "attempt counted",
                claim.run_id,
                reason,
            )
        else:
            logger.debug("preemptible: run %s could not start either: %s", claim.run_id, reason)
        return self._count_failure(
            f"the last {self._streak + 1} runs could not start ({reason}); they are back in "
            "the queue with nothing counted against them: fix that and start the agent again",
            EXIT_CANNOT_START,
        )

    def _count_failure(self, why: str, code: int) -> int | None:
        """One more run in a row that could not start or failed at once: back off, or stop."""
        self._streak += 1
        limit = self.config.max_consecutive_failures
        if limit and self._streak >= limit:
            logger.error("preemptible: agent stops: %s (--max-consecutive-failures %d)", why, limit)
            return code
        delay = min(2.0 ** (self._streak - 1), MAX_BACKOFF)
        logger.info("preemptible: next claim in %.0f s", delay)
        self._wait(delay)
        return None

    def _abandon(self, claim: Claim) -> None:
        try:
            self.store.abandon(
                claim.run_id, agent=self.id, attempt=claim.attempt, epoch=claim.epoch
            )
        except LeaseLost as exc:  # cannot be, but must not stop the agent
            logger.warning("preemptible: %s", exc)

    def _finish_unstartable(self, claim: Claim) -> None:
        """A run that no agent can start (its id from the database is not a name): FAILED,
        on its own failure budget."""
        self.store.finish(
            claim.run_id,
            agent=self.id,
            attempt=claim.attempt,
            epoch=claim.epoch,
            ending=Ending.FAILED,
            exit_code=None,
            duration=0.0,
            checkpoint_step=None,
            summary=None,
        )
