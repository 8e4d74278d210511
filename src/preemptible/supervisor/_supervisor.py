"""``preemptible run``: start the job, pass signals on, classify each ending, restart or requeue."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import select
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from .._checkpoint import CheckpointStore
from .._errors import ConfigError, PreemptibleError
from .._run import read_record
from ..notices import grace_period_from_env
from . import _slurm
from ._classify import Ending, RunState, classify, exit_code_for
from ._process import ProcessGroup, become_subreaper

logger = logging.getLogger("preemptible")

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
DEFAULT_TERM_TIMEOUT = 60.0
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise ConfigError(
            f"run id {run_id!r} is not valid; use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return run_id


@dataclass(kw_only=True)
class SupervisorConfig:
    command: list[str]
    checkpoint_dir: Path | None = None
    max_failures: int = 0
    max_preemptions: int | None = None  # None: unlimited
    term_timeout: float | None = None  # None: from the platform, else DEFAULT_TERM_TIMEOUT
    forward_signals: bool = True
    pid_file: Path | None = None
    home: Path = field(default_factory=lambda: Path(".preemptible"))
    run_id: str | None = None
    restart_delay: float = 1.0
    max_restart_delay: float = 300.0
    heartbeat_interval: float = 10.0
    flap_attempts: int = 5
    min_uptime: float = 10.0

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError(
                "no command given; put it after --, e.g. preemptible run -- python train.py"
            )
        for name in ("max_failures", "max_preemptions", "flap_attempts"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ConfigError(f"{name}={value!r} is not valid; use an integer >= 0")
        for name in ("term_timeout", "restart_delay", "heartbeat_interval", "min_uptime"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name}={value!r} is not valid; use seconds >= 0")
        if self.run_id is not None:
            check_run_id(self.run_id)


@dataclass
class Attempt:
    number: int
    pid: int
    state: RunState
    ending: Ending
    exit_code: int
    duration: float
    signals: list[str]

    def as_json(self) -> dict[str, Any]:
        return {
            "attempt": self.number,
            "pid": self.pid,
            "state": str(self.state),
            "ending": self.ending.describe(),
            "exit_code": self.exit_code,
            "duration_s": round(self.duration, 3),
            "signals": self.signals,
            "ended_at": time.time(),
        }


class Supervisor:
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.run_id = config.run_id or self._default_run_id()
        self.run_dir = config.home / "runs" / self.run_id
        self.checkpoint_dir = config.checkpoint_dir or self.run_dir / "checkpoints"
        self.signals: list[tuple[int, float]] = []  # received since the supervisor started
        self.attempts: list[Attempt] = []
        self._group: ProcessGroup | None = None
        self._pending: list[int] = []
        self._wake_r = self._wake_w = -1
        self._previous: dict[int, Any] = {}

    @staticmethod
    def _default_run_id() -> str:
        job = _slurm.job_id()
        if job is not None:
            return f"slurm-{job}"  # stable across requeues of the same job
        return os.environ.get("PREEMPTIBLE_RUN_ID") or uuid.uuid4().hex[:12]

    # -- signals ---------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append((signum, time.time()))
        if not self.config.forward_signals:
            return
        group = self._group
        if group is not None:
            group.signal(signum)  # the whole group: a trainer under bash -c or torchrun too
        else:
            self._pending.append(signum)  # the attempt is starting; passed on once it has

    def _install(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in FORWARDED:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        # SIGCHLD needs a Python handler for the wakeup fd to see it.
        self._previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, lambda s, f: None)

    def _uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()
        signal.set_wakeup_fd(-1)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _sleep(self, seconds: float) -> None:
        """Wait up to ``seconds``, returning early when any signal (SIGCHLD too) arrives."""
        if seconds > 0:
            with contextlib.suppress(InterruptedError):
                select.select([self._wake_r], [], [], seconds)
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 512):
                pass

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> int:
        become_subreaper()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._install()
        try:
            return self._loop()
        finally:
            self._uninstall()
            if self.config.pid_file is not None:
                with contextlib.suppress(OSError):
                    self.config.pid_file.unlink()

    def _loop(self) -> int:
        failures = preemptions = 0
        delay = 0.0
        code = 0
        while True:
            if self.signals:
                logger.warning("preemptible: told to stop before the next attempt; exiting")
                return code if self.attempts else 128 + self.signals[0][0]
            attempt = self._attempt(self._next_number())
            code = attempt.exit_code
            state = attempt.state
            told_to_stop = bool(self.signals)
            if state is RunState.FINISHED or state is RunState.KILLED:
                return code
            if state is RunState.PREEMPTED:
                if _slurm.in_batch_job():
                    _slurm.requeue()
                    return code
                if told_to_stop:
                    return code
                if (
                    self.config.max_preemptions is not None
                    and preemptions >= self.config.max_preemptions
                ):
                    logger.error(
                        "preemptible: preempted %d times, the --max-preemptions budget; giving up",
                        preemptions + 1,
                    )
                    return code
                preemptions += 1
                delay = self.config.restart_delay
            else:  # FAILED, CRASHED
                if told_to_stop:
                    return code
                if failures >= self.config.max_failures:
                    if self.config.max_failures:
                        logger.error(
                            "preemptible: %s %d times, the --max-failures budget; giving up",
                            str(state).lower(),
                            failures + 1,
                        )
                    return code
                failures += 1
                delay = min(
                    self.config.restart_delay * 2 ** (failures - 1), self.config.max_restart_delay
                )
            if self._flapping():
                return code
            logger.info("preemptible: restarting in %.1f s", delay)
            deadline = time.monotonic() + delay
            while not self.signals and time.monotonic() < deadline:
                self._sleep(deadline - time.monotonic())

    def _flapping(self) -> bool:
        n = self.config.flap_attempts
        recent = self.attempts[-n:]
        if n and len(recent) == n and all(a.duration < self.config.min_uptime for a in recent):
            logger.error(
                "preemptible: the last %d attempts each ended within %.0f s; giving up instead "
                "of restarting in a loop (look at the attempt logs above)",
                n,
                self.config.min_uptime,
            )
            return True
        return False

    def _next_number(self) -> int:
        numbers = [
            int(p.name.split("-", 1)[1])
            for p in self.run_dir.glob("attempt-*")
            if p.name.split("-", 1)[1].isdigit()
        ]
        return max(numbers, default=0) + 1

    def _environment(self, number: int, attempt_dir: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PREEMPTIBLE_RUN_ID=self.run_id,
            PREEMPTIBLE_ATTEMPT=str(number),
            PREEMPTIBLE_RUN_DIR=str(attempt_dir.resolve()),
            PREEMPTIBLE_CHECKPOINT_DIR=str(self.checkpoint_dir.resolve()),
        )
        env.pop("PREEMPTIBLE_RESUME_FROM", None)
        latest = CheckpointStore(self.checkpoint_dir).latest()
        if latest is not None:
            env["PREEMPTIBLE_RESUME_FROM"] = str(latest.path.resolve())
        return env

    def _attempt(self, number: int) -> Attempt:
        attempt_dir = self.run_dir / f"attempt-{number}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        env = self._environment(number, attempt_dir)
        first_signal = len(self.signals)
        try:
            group = ProcessGroup(self.config.command, env=env)
        except OSError as exc:
            raise PreemptibleError(
                f"cannot start {self.config.command[0]!r}: {exc.strerror or exc}"
            ) from exc
        self._group = group
        while self._pending:
            group.signal(self._pending.pop(0))
        if self.config.pid_file is not None:
            _write_atomic(self.config.pid_file, f"{group.pid}\n")
        logger.info(
            "preemptible: attempt %d of run %s started: pid %d%s",
            number,
            self.run_id,
            group.pid,
            f", resuming from {env['PREEMPTIBLE_RESUME_FROM']}"
            if "PREEMPTIBLE_RESUME_FROM" in env
            else "",
        )
        kill_at: float | None = None
        killed = False
        next_beat = 0.0
        try:
            while not group.reap():
                now = time.monotonic()
                if kill_at is None and len(self.signals) > first_signal:
                    timeout, source = self.term_timeout()
                    kill_at = now + timeout
                    logger.info(
                        "preemptible: %s %s the job; SIGKILL in %.0f s if it has not exited (%s)",
                        _name(self.signals[first_signal][0]),
                        "passed on to"
                        if self.config.forward_signals
                        else "received; not passed to",
                        timeout,
                        source,
                    )
                if kill_at is not None and now >= kill_at and not killed:
                    logger.error(
                        "preemptible: the job is still running %.0f s after the stop signal; "
                        "sending SIGKILL to its process group",
                        timeout,
                    )
                    group.signal(signal.SIGKILL)
                    killed = True
                if now >= next_beat:
                    self._heartbeat(number, group)
                    next_beat = now + self.config.heartbeat_interval
                wake = min(next_beat, kill_at if kill_at is not None and not killed else math.inf)
                self._sleep(min(max(wake - now, 0.0), 1.0))
        finally:
            self._group = None
            group.close()
        ending = group.ending or Ending(lost=True)
        record = read_record(attempt_dir)
        mine = self.signals[first_signal:]
        state = classify(ending, record, first_signal_at=mine[0][1] if mine else None)
        code = exit_code_for(state, ending, record, mine[0][0] if mine else None)
        attempt = Attempt(
            number, group.pid, state, ending, code, group.duration, [_name(s) for s, _ in mine]
        )
        self.attempts.append(attempt)
        with open(self.run_dir / "attempts.jsonl", "a") as fh:
            fh.write(json.dumps(attempt.as_json()) + "\n")
        logger.log(
            logging.INFO if state is RunState.FINISHED else logging.WARNING,
            "preemptible: attempt %d: pid %d, %s (%s), exit code %d, %.1f s%s",
            number,
            group.pid,
            state,
            ending.describe(),
            code,
            group.duration,
            f", stopped at step {record['step']}, checkpoint {record.get('checkpoint')}"
            if record.get("state") in ("stopping", "stopped")
            else "",
        )
        return attempt

    def term_timeout(self) -> tuple[float, str]:
        return term_timeout(self.config.term_timeout)

    def _heartbeat(self, number: int, group: ProcessGroup) -> None:
        beat = {"pid": os.getpid(), "attempt": number, "child_pid": group.pid, "at": time.time()}
        with contextlib.suppress(OSError):
            _write_atomic(self.run_dir / "heartbeat.json", json.dumps(beat))


def term_timeout(explicit: float | None = None) -> tuple[float, str]:
    """Seconds from the first stop signal to SIGKILL, and where the number came from."""
    if explicit is not None:
        return explicit, "--term-timeout"
    try:
        grace = grace_period_from_env()
    except ConfigError as exc:
        logger.warning("preemptible: ignoring it: %s", exc)
        grace = None
    if grace is not None:
        return max(grace - 2.0, 1.0), "PREEMPTIBLE_GRACE_PERIOD minus 2 s"
    left = _slurm.time_left()
    if left is not None and left < 10 * DEFAULT_TERM_TIMEOUT:
        return max(left - 5.0, 5.0), "the SLURM job's time left minus 5 s"
    return DEFAULT_TERM_TIMEOUT, "the default; set --term-timeout"


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
