"""``preemptible agent``: take runs of a sweep from the queue and run each one to its end.

Each claimed run is one attempt of ``preemptible run``'s machinery (``Supervisor.run_attempt``):
the same process group, signal forwarding, escalation, subreaper, guardian, run record and
classification, so an agent and ``preemptible run`` can never disagree about how an attempt
ended. What the agent adds is the queue:

- a heartbeat thread renews the run's lease (on its own database connection), copies the
  metrics the run reported (``preemptible.report``) into the queue, marks the run preempting
  when the run did, and passes a sweep's ``cancel`` on to the run (SIGTERM, then SIGKILL after
  the term timeout; ``--now``: SIGKILL);
- when the attempt ends, ``finish`` records it and the queue decides the run's next state
  (PREEMPTED runs go back to the queue with the same id and checkpoint directory, and the next
  agent resumes them);
- a lost lease (this agent was cut off from the database for longer than the lease, and the
  run was handed to another agent) kills the run at once: two attempts must never write one
  checkpoint directory.

Stopping an agent (SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2): the signal goes to the run,
which saves and exits; the agent records the attempt (the run goes back to the queue) and exits
128 + signum without claiming again. Between runs it exits at once. A second signal reaches
the run as a second signal: it exits at once, as under ``preemptible run``.

Agents on several machines must share the directory of runs (``--home``): checkpoints of a
preempted run are resumed by whichever agent takes it next.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from .._errors import ConfigError, PreemptibleError
from .._report import read_summary
from .._run import read_record
from ..checkpoint._store import CheckpointStore
from ._command import build_command
from ._sample import Observation, propose
from ._spec import SweepSpec, parse_spec
from ._store import Claim, LeaseLost, Store, StoreError, clean_step, open_store, printable

logger = logging.getLogger("preemptible")

# what an agent takes as a stop: the signals the supervisor passes on to a run
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
DEFAULT_HEARTBEAT = 10.0
DEFAULT_LEASE = 60.0


@dataclass(frozen=True)
class AgentConfig:
    sweep_id: str
    db: str | None = None
    count: int | None = None
    heartbeat: float = DEFAULT_HEARTBEAT
    lease: float = DEFAULT_LEASE
    home: Path = field(default_factory=lambda: Path(".preemptible"))

    def __post_init__(self) -> None:
        if self.count is not None and (isinstance(self.count, bool) or self.count < 1):
            raise ConfigError(f"--count {self.count!r} is not valid; use an integer >= 1")
        if not (0 < self.heartbeat < float("inf")):
            raise ConfigError(f"--heartbeat {self.heartbeat!r} is not valid; use seconds > 0")
        if not (self.heartbeat < self.lease < float("inf")):
            raise ConfigError(
                f"--lease {self.lease:g} is not valid; use more seconds than --heartbeat "
                f"({self.heartbeat:g}): a lease renewed less often than it lasts expires"
            )


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.host = socket.gethostname()
        self.id = f"{os.getpid()}-{secrets.token_hex(4)}"  # shown as agent@host
        self.store = open_store(config.db)
        self.sweep = self.store.sweep(config.sweep_id)  # an unknown sweep fails here: one line
        self.spec: SweepSpec = parse_spec(self.sweep.spec, source=f"sweep {self.sweep.id}")
        self.done = 0
        self._signals: list[int] = []
        self._previous: dict[int, Any] = {}
        self._supervisor: Any = None

    # -- signals between runs ----------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)  # bookkeeping only; the loop looks at it

    def _install(self) -> None:
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) == signal.SIG_IGN:
                continue  # nohup: the hang-up stays ignored
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._signals and time.monotonic() < deadline:
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        self._install()
        try:
            return self._loop()
        finally:
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
            )
            if claim is None:
                if self._nothing_left():
                    return 0
                self._wait(self.config.heartbeat)
                continue
            code = self._run(claim)
            self.done += 1
            if code is not None:
                return code

    def _propose(self, history: list[Observation], index: int) -> dict[str, Any] | None:
        return propose(self.spec, history, index=index, seed=self.sweep.seed)

    def _stopped(self, signum: int) -> int:
        logger.warning(
            "preemptible: agent stopped by %s; no more runs claimed", signal.Signals(signum).name
        )
        return 128 + signum

    def _nothing_left(self) -> bool:
        """Whether this agent is done: the sweep is stopped or cancelled, or it has nothing
        pending or running. While another agent's run may still come back, it waits."""
        sweep = self.store.sweep(self.sweep.id)
        if sweep.control in ("stopped", "cancelled"):
            logger.info("preemptible: sweep %s is %s; agent exits", sweep.id, sweep.control)
            return True
        if sweep.control == "paused":
            return False
        states = {r.state for r in self.store.runs(sweep.id)}
        if states & {"PENDING", "RUNNING"}:
            return False
        logger.info("preemptible: sweep %s has nothing left to run; agent exits", sweep.id)
        return True

    # -- one run -----------------------------------------------------------------------------
    def _run(self, claim: Claim) -> int | None:
        """One attempt of ``claim``; the agent's exit code when it must stop, else None."""
        from ..supervisor import Supervisor, SupervisorConfig

        run_dir = self.config.home / "runs" / claim.run_id
        logger.info(
            "preemptible: run %s (#%d) attempt %d: %s",
            claim.run_id,
            claim.index,
            claim.attempt,
            _describe(claim.params),
        )
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            command = build_command(
                self.spec,
                claim.params,
                interpreter=sys.executable,
                params_file=run_dir / "params.json",
            )
            supervisor = Supervisor(
                SupervisorConfig(
                    command=command,
                    run_id=claim.run_id,
                    home=self.config.home,
                    term_timeout=self.spec.term_timeout,
                )
            )
        except (OSError, PreemptibleError) as exc:
            logger.error("preemptible: run %s could not start: %s", claim.run_id, exc)
            self._fail_to_start(claim)
            return None
        if self._signals:  # told to stop between the claim and the start
            self.store.release(claim.run_id, agent=self.id, attempt=claim.attempt)
            return self._stopped(self._signals[0])
        beat = _Heartbeat(self, claim, supervisor, run_dir / f"attempt-{claim.attempt}")
        self._restore()  # the supervisor takes the signals while the run runs
        beat.start()
        try:
            attempt = supervisor.run_attempt(claim.attempt)
        except PreemptibleError as exc:  # it could not start (no such program, a lock held)
            logger.error("preemptible: run %s could not start: %s", claim.run_id, exc)
            self._fail_to_start(claim)
            return None
        finally:
            beat.stop()
            self._install()
        received = [
            s.signum for s in supervisor.signals if not any(s is r for r in supervisor.requested)
        ]
        if beat.lost:
            logger.error(
                "preemptible: run %s attempt %d lost its lease (another agent took the run); "
                "the attempt was killed and is not recorded here",
                claim.run_id,
                claim.attempt,
            )
        else:
            attempt_dir = run_dir / f"attempt-{claim.attempt}"
            record = read_record(attempt_dir)
            state = self.store.finish(
                claim.run_id,
                agent=self.id,
                attempt=claim.attempt,
                ending=str(attempt.state),
                exit_code=attempt.exit_code,
                duration=attempt.duration,
                checkpoint_step=_newest_step(supervisor.resume_dir),
                summary=read_summary(attempt_dir) or None,
                marked_preempting=bool(record.get("preempting")),
            )
            logger.info(
                "preemptible: run %s attempt %d ended %s; the run is %s",
                claim.run_id,
                claim.attempt,
                attempt.state,
                state,
            )
        if received:
            return self._stopped(received[0])
        return None

    def _fail_to_start(self, claim: Claim) -> None:
        """The run cannot even start here (its command, this machine's disk): FAILED, so that
        its failure budget, not an endless loop of claims, decides what happens to it."""
        self.store.finish(
            claim.run_id,
            agent=self.id,
            attempt=claim.attempt,
            ending="FAILED",
            exit_code=None,
            duration=0.0,
            checkpoint_step=None,
            summary=None,
        )


class _Heartbeat:
    """Renews the lease while the attempt runs, on a connection of its own, and passes the
    queue's news (cancel, a lost lease) to the supervisor."""

    def __init__(self, agent: Agent, claim: Claim, supervisor: Any, attempt_dir: Path) -> None:
        self.agent, self.claim, self.supervisor = agent, claim, supervisor
        self.attempt_dir = attempt_dir
        self.lost = False
        self._done = threading.Event()
        self._store: Store | None = None
        self._thread = threading.Thread(target=self._loop, name="preemptible-lease", daemon=True)

    def start(self) -> None:
        self._store = open_store(self.agent.config.db)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        if self._store is not None:
            self._store.close()

    def _loop(self) -> None:
        store = self._store
        assert store is not None
        config, claim = self.agent.config, self.claim
        summary: dict[str, Any] = {}
        marked = cancelled = False
        while not self._done.wait(config.heartbeat):
            try:
                control = store.heartbeat(
                    claim.run_id, agent=self.agent.id, lease=config.lease, attempt=claim.attempt
                )
                if not marked and read_record(self.attempt_dir).get("preempting"):
                    store.mark_preempting(claim.run_id, attempt=claim.attempt)
                    marked = True
                latest = read_summary(self.attempt_dir)
                if latest and latest != summary:
                    store.report(claim.run_id, latest)
                    summary = latest
            except LeaseLost:
                self.lost = True
                self._inject(signal.SIGKILL)
                return
            except (StoreError, OSError) as exc:  # the database is away: the lease may run out
                logger.warning("preemptible: heartbeat of run %s failed: %s", claim.run_id, exc)
                continue
            except PreemptibleError as exc:  # a value the queue refused: keep the lease alive
                logger.warning(
                    "preemptible: heartbeat of run %s: %s; the run goes on", claim.run_id, exc
                )
                continue
            if control.control == "cancelled" and (not cancelled or control.cancel_now):
                now = control.cancel_now
                logger.warning(
                    "preemptible: sweep %s cancelled%s; stopping run %s",
                    claim.sweep_id,
                    " --now" if now else "",
                    claim.run_id,
                )
                self._inject(signal.SIGKILL if now else signal.SIGTERM)
                cancelled = True
                if now:
                    return

    def _inject(self, signum: int) -> None:
        self.supervisor.stop_job(signum)


def _newest_step(directory: Path) -> int | None:
    """The step of the run's newest checkpoint; None if there is none, it cannot be read, or
    its step does not fit the queue's 64-bit column (a hand-made file name, say)."""
    try:
        newest = CheckpointStore(directory).latest()
    except (OSError, ValueError, OverflowError):
        return None
    if newest is None:
        return None
    return clean_step(newest.step, str(directory))


def _describe(params: dict[str, Any]) -> str:
    """The parameters for the log, one line, with control characters escaped."""
    text = " ".join(f"{k}={v}" for k, v in sorted(params.items())) or "(no parameters)"
    return printable(text)
