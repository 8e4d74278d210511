"""``preemptible run``: start the job, pass signals on, classify each ending, restart or requeue.

One supervisor per run: ``runs/RUN_ID/supervisor.lock`` is held (``flock``) for the
supervisor's lifetime, so a second ``preemptible run`` of the same run cannot interleave its
attempts and files with the first. The run id is stable by default (from the checkpoint
directory, else from the working directory and the command; ``slurm-JOBID`` under SLURM), so
running the same command again continues the same run.

Signals: INT, TERM, HUP, USR1 and USR2 are passed on to the job's whole process group. The
same signal again within ``DUPLICATE_WINDOW`` (0.5 s) of the last one passed on is the same
stop delivered twice (a process tree signalled as a whole, two quick SIGTERMs from an
orchestrator): it is recorded, not passed on. A person's second Ctrl+C a second later is
passed on, and the trainer exits at once.

How long an attempt lasts, i.e. which processes it waits for:

- the whole process group of the job, as long as a stop was passed on: a wrapper shell may die
  from the signal while the trainer under it is still saving. Escalation: SIGKILL to the group
  ``term_timeout()`` seconds after the first stop signal.
- when no stop was passed on and the job's main process (the group leader) has exited, the
  rest of its group gets ``linger`` seconds (5 s), then SIGTERM, then SIGKILL ``linger``
  seconds later: a background process the job left in its group (``tensorboard &`` in a
  wrapper script) must not keep a finished attempt open forever.
- processes the job started outside its group (a daemon that called ``setsid()``, torchrun's
  workers in sessions of their own) are found in the attempt's cgroup, or through /proc
  (``_process.py``); when the attempt ends they get SIGTERM, then SIGKILL ``linger`` seconds
  later. The guardian tracks them on its own, so a ``kill -9`` of the supervisor does not
  leave them; a dead guardian is replaced at once.

Before its first attempt a supervisor stops what earlier attempts of the run left running
when their supervisor and guardian were killed together (SIGTERM, so that a trainer saves,
then SIGKILL a term timeout later): the next attempt resumes from that save instead of
meeting a checkpoint lock that an orphan holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import select
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

from .._env import env_str
from .._errors import ConfigError, PreemptibleError, RunLockedError
from .._files import open_in_place, write_text_atomic
from .._run import RECORD_NAME, read_record
from ..checkpoint._history import tail_lines as _tail
from ..checkpoint._store import CheckpointStore
from ..notices import KUBERNETES_DEFAULT_GRACE as KUBERNETES_GRACE
from ..notices import grace_period_from_env
from ..stop._latch import DUPLICATE_WINDOW, KEEP_IGNORED
from ..stop._termination import EXIT_SECONDS_ENV, signal_exit_code
from . import _slurm
from ._cgroup import Containment, cgroup_name, choose, remove_stale
from ._classify import Ending, RunState, classify, exit_code_for
from ._guard import read_proc
from ._process import MAX_GUARDIAN_CRASHES, EarlierAttempts, ProcessGroup, become_subreaper
from ._record import RunRecord, _time, load_record

logger = logging.getLogger("preemptible")

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
DEFAULT_TERM_TIMEOUT = 60.0
MAX_RESTART_DELAY = 86400.0  # a day: longer is a typo, and select() refuses huge timeouts
WATCH_INTERVAL = 2.0  # seconds between looks for processes that left the job's group
LOCK_NAME = "supervisor.lock"
LOCK_WAIT = 15.0  # seconds a guardian may take to stop the attempt of a supervisor killed
JOURNAL_NAME = "attempts.jsonl"
JOURNAL_TAIL_BYTES = 1 << 16  # the journal's last attempts; a line is ~300 bytes
EXIT_HISTORY = 3  # measured exits passed on: the next attempt budgets the longest of these
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# what a nested run passes up from its last attempt's record to its parent's attempt
PASSED_UP = (
    "state",
    "preempting",
    "preempting_at",
    "stopped_at",
    "committed_at",
    "signum",
    "step",
    "checkpoint",
    "checkpoint_dir",
)


def check_run_id(run_id: str, source: str = "--run-id") -> str:
    """``run_id`` names a directory under --home: refuse anything that is not a plain name."""
    if not _RUN_ID.fullmatch(run_id):
        raise ConfigError(
            f"run id {run_id!r} (from {source}) is not valid; use 1-128 letters, digits, '.', "
            "'_' or '-', starting with a letter or digit"
        )
    return run_id


def parent_run() -> str | None:
    """The run whose attempt this process is part of (a supervisor gave it
    ``PREEMPTIBLE_RUN_ID`` and ``PREEMPTIBLE_RUN_DIR``), or None."""
    if env_str("PREEMPTIBLE_RUN_DIR") is None:
        return None
    return env_str("PREEMPTIBLE_RUN_ID")


def default_run_id(command: list[str], checkpoint_dir: Path | None) -> tuple[str, str]:
    """The run id when none was given, and why it is that one. Stable: the same job started
    again (by hand, by a scheduler, after a crash of the supervisor) continues the same run
    directory, attempt numbers and default checkpoints instead of starting a new history.

    Inside an attempt of another run (a job script that itself uses ``preemptible run``,
    under an agent or another supervisor) the run is a run of its own: its id is derived as
    below, together with the parent run's id, and never the SLURM job's, which the parent
    has; the same parent run gets the same nested run again, so resumes work at both levels.
    """
    parent = parent_run()
    job = _slurm.job_id() if parent is None else None
    if job is not None:
        run_id = check_run_id(f"slurm-{job}", "the SLURM job id")
        return run_id, "the SLURM job; a requeued job continues this run"
    try:
        if checkpoint_dir is not None:
            where = checkpoint_dir.resolve()
            name, key = where.name, str(where)
            why = f"from the checkpoint directory {where}"
        else:
            cwd = Path.cwd()
            name, key = _command_name(command), "\0".join([str(cwd), *command])
            why = f"from the working directory {cwd} and the command"
    except OSError as exc:  # the working directory was removed under us
        raise ConfigError(f"cannot derive a run id ({exc.strerror or exc}); pass --run-id") from exc
    if parent is not None:
        key = f"{parent}\0{key}"
        why = f"inside an attempt of run {parent!r}; {why}"
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).lstrip("-._")[:40] or "run"
    return f"{slug}-{digest}", why


def _command_name(command: list[str]) -> str:
    """``train`` for ``python train.py``, ``mod`` for ``python -m pkg.mod``, else the program."""
    args = command[1:]
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args):
            return args[i + 1].rsplit(".", 1)[-1]
        if not arg.startswith("-") and Path(arg).suffix in (".py", ".sh"):
            return Path(arg).stem
    return Path(command[0]).name


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
    linger: float = 5.0  # for what the job leaves running: see the module docstring
    extra_env: dict[str, str] = field(default_factory=dict)  # for every attempt (an agent's)

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError(
                "no command given; put it after --, e.g. preemptible run -- python train.py"
            )
        for name in ("max_failures", "max_preemptions", "flap_attempts"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ConfigError(f"{name}={value!r} is not valid; use an integer >= 0")
        for name in ("term_timeout", "heartbeat_interval", "min_uptime", "linger"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name}={value!r} is not valid; use seconds >= 0")
        for name in ("restart_delay", "max_restart_delay"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= MAX_RESTART_DELAY):
                raise ConfigError(
                    f"{name}={value!r} is not valid; use seconds from 0 to {MAX_RESTART_DELAY:g}"
                )
        if self.run_id is not None:
            check_run_id(self.run_id)


class Received(NamedTuple):
    """A signal the supervisor got: which, when (wall time), and whether it was passed on."""

    signum: int
    at: float
    forwarded: bool


@dataclass
class Attempt:
    number: int
    pid: int
    state: RunState
    ending: Ending
    exit_code: int
    duration: float
    signals: list[Received] = field(default_factory=list)
    exit_seconds: float | None = None  # from the final commit to the last process reaped

    def as_json(self) -> dict[str, Any]:
        return {
            "attempt": self.number,
            "pid": self.pid,
            "state": str(self.state),
            "ending": self.ending.describe(),
            "exit_code": self.exit_code,
            "duration_s": round(self.duration, 3),
            "signals": [_name(s.signum) for s in self.signals],
            "forwarded": [s.forwarded for s in self.signals],
            "ended_at": time.time(),
            **({} if self.exit_seconds is None else {"exit_s": round(self.exit_seconds, 3)}),
        }


class RestartPolicy:
    """Whether, and after how long, to start another attempt. Preemptions and failures have
    separate budgets (a preemption is not the run's fault); only failures back off."""

    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.failures = 0
        self.preemptions = 0

    def delay_after(self, attempts: list[Attempt]) -> float | None:
        """Seconds to wait before the next attempt, or None to stop (logged)."""
        c = self.config
        if attempts[-1].state is RunState.PREEMPTED:
            if c.max_preemptions is not None and self.preemptions >= c.max_preemptions:
                logger.error(
                    "preemptible: preempted %d times; --max-preemptions is %d; giving up",
                    self.preemptions + 1,
                    c.max_preemptions,
                )
                return None
            self.preemptions += 1
            delay = c.restart_delay
        else:
            if self.failures >= c.max_failures:
                if c.max_failures:
                    logger.error(
                        "preemptible: %d attempts failed or crashed; --max-failures is %d; "
                        "giving up",
                        self.failures + 1,
                        c.max_failures,
                    )
                return None
            self.failures += 1
            # the exponent is capped so that no budget can overflow the float
            backoff = c.restart_delay * 2.0 ** min(self.failures - 1, 64)
            delay = min(backoff, max(c.max_restart_delay, c.restart_delay))
        return None if self._flapping(attempts) else delay

    def _flapping(self, attempts: list[Attempt]) -> bool:
        n = self.config.flap_attempts
        recent = attempts[-n:]
        if n and len(recent) == n and all(a.duration < self.config.min_uptime for a in recent):
            logger.error(
                "preemptible: the last %d attempts each ended within %.0f s; giving up instead "
                "of restarting in a loop (look at the attempt logs above)",
                n,
                self.config.min_uptime,
            )
            return True
        return False


@dataclass
class _Escalation:
    """What the supervisor does to an attempt's group, and when (monotonic times)."""

    kill_at: float | None = None  # SIGKILL, a term timeout after the first stop signal
    timeout: float = 0.0
    leader_gone: float | None = None  # when the job's main process was seen to exit
    linger: list[tuple[float, int]] = field(default_factory=list)  # (when, signal)
    killed: bool = False  # every process of the attempt was SIGKILLed

    def next_at(self) -> float:
        return min([self.kill_at or math.inf, *(t for t, _ in self.linger)])


class Supervisor:
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        _slurm.in_batch_job()  # a bad SLURM job id fails here, before anything starts
        if config.run_id is not None:
            self.run_id, self._run_id_why = config.run_id, ""
        else:
            self.run_id, self._run_id_why = default_run_id(config.command, config.checkpoint_dir)
        self.run_dir = config.home / "runs" / self.run_id
        self.checkpoint_dir = config.checkpoint_dir or self.run_dir / "checkpoints"
        # where the job really saves (its record's checkpoint_dir); resumes come from here
        self.resume_dir = self.checkpoint_dir
        self._named_resume: tuple[int, Path] | None = None  # (step, path) the record named
        self.signals: list[Received] = []  # received since the supervisor started
        self.requested: list[Received] = []  # of those, the stops asked for by stop_job()
        self.attempts: list[Attempt] = []
        self.policy = RestartPolicy(config)
        self._group: ProcessGroup | None = None
        self._pending: list[int] = []
        self._last_forward: tuple[int, float] | None = None  # (signum, monotonic time)
        self._logged_signals = 0
        self._wake_r = self._wake_w = -1
        self._previous: dict[int, Any] = {}
        self._lock_fd = -1
        self._pid_text: str | None = None
        self._warned: set[str] = set()
        self._exit_code: int | None = None
        self.containment: Containment | None = None
        self.parent = parent_run()  # a nested run: the run whose attempt started this one

    # -- signals ---------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Bookkeeping and killpg only: this runs between two bytecodes of the main loop.
        now = time.monotonic()
        last = self._last_forward
        duplicate = last is not None and last[0] == signum and now - last[1] <= DUPLICATE_WINDOW
        forward = self.config.forward_signals and not duplicate
        self.signals.append(Received(signum, time.time(), forward))
        if not forward:
            return
        self._last_forward = (signum, now)
        group = self._group
        if group is not None:
            group.signal(signum)  # the whole group: a trainer under bash -c or torchrun too
        else:
            self._pending.append(signum)  # the attempt is starting; passed on once it has

    def _log_signals(self, first: int) -> None:
        """Log, outside the handler, the signals after the attempt's first one."""
        while self._logged_signals < len(self.signals):
            index = self._logged_signals
            self._logged_signals += 1
            if index <= first:
                continue  # the first is logged with the escalation
            s, before = self.signals[index], self.signals[index - 1]
            if s.forwarded:
                logger.warning("preemptible: %s again; passed on to the job", _name(s.signum))
            elif self.config.forward_signals:
                logger.info(
                    "preemptible: %s again %.3f s later: the same stop delivered twice "
                    "(within %.1f s), not passed on",
                    _name(s.signum),
                    s.at - before.at,
                    DUPLICATE_WINDOW,
                )

    def _install(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
            os.set_inheritable(fd, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in FORWARDED:
            if sig in KEEP_IGNORED and signal.getsignal(sig) == signal.SIG_IGN:
                # started under nohup (or as a background job): the hang-up stays ignored,
                # here and in the job, which inherits the ignored disposition
                logger.info(
                    "preemptible: %s ignored since the supervisor started; not passed on",
                    signal.Signals(sig).name,
                )
                continue
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
                select.select([self._wake_r], [], [], min(seconds, MAX_RESTART_DELAY))
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 512):
                pass

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> int:
        """Attempts until the run ends (the restart policy); the exit code of the last."""
        with self._session():
            self._exit_code = self._loop()
            if self.parent is not None and self.attempts:
                self._tell_parent()
            return self._exit_code

    def run_attempt(self, number: int) -> Attempt:
        """One attempt, numbered ``number``, for a caller that owns the restart policy
        (``preemptible agent``, whose queue decides what comes next): the same forwarding,
        escalation, subreaper, guardian, journal and classification as ``run()``."""
        with self._session():
            attempt = self._attempt(number)
            self._exit_code = attempt.exit_code
            return attempt

    @property
    def job_group(self) -> int | None:
        """The process group of the running attempt's job, None between attempts."""
        group = self._group
        return None if group is None else group.pid

    def stop_job(self, signum: int) -> None:
        """Stop the running attempt as a received ``signum`` would, from another thread (a
        sweep's cancel; SIGKILL for a lost lease or ``cancel --now``): passed on to the group,
        then the escalation. Listed in ``requested`` too, to tell it from a real signal."""
        received = Received(signum, time.time(), True)
        self.requested.append(received)
        self.signals.append(received)
        self._last_forward = (signum, time.monotonic())
        group = self._group
        if group is not None:
            group.signal(signum)
        else:
            self._pending.append(signum)
        with contextlib.suppress(OSError, ValueError):
            os.write(self._wake_w, b"\0")  # the wait in _supervise looks again now

    @contextlib.contextmanager
    def _session(self) -> Iterator[None]:
        self._prepare()
        become_subreaper()
        self._install()
        try:
            self._stop_earlier_attempts()
            yield
        finally:
            self._uninstall()
            self._heartbeat_final()
            self._remove_pid_file()
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # releases the run's lock

    def _prepare(self) -> None:
        """Everything that can fail on bad input, before any job starts: one line each."""
        if self.config.pid_file is not None:
            _check_writable(self.config.pid_file, "--pid-file")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PreemptibleError(
                f"cannot create the run directory {self.run_dir}: {exc.strerror or exc}; "
                "give --home (PREEMPTIBLE_HOME) a writable directory"
            ) from exc
        self.containment = choose()
        if self.containment.parent is not None:
            remove_stale(self.containment.parent)
        logger.debug("preemptible: attempts are contained by %s", self.containment.describe())
        self._lock_fd = _lock_run(self.run_dir, self.run_id)  # last: nothing fails after it
        if self._run_id_why:
            logger.info(
                "preemptible: run %s (%s); a rerun of the same command continues this run; "
                "pass --run-id to start another",
                self.run_id,
                self._run_id_why,
            )

    def _stop_earlier_attempts(self) -> None:
        """Stop what earlier attempts of this run left running (their supervisor and guardian
        were killed together); see the module docstring."""
        earlier = EarlierAttempts(self.run_dir, self.run_id)
        left = earlier.alive()
        if not left:
            return
        timeout, source = self.term_timeout()
        logger.warning(
            "preemptible: %d process(es) of an earlier attempt of run %s are still running "
            "without their supervisor (pids %s); stopping them before the next attempt: "
            "SIGTERM, SIGKILL in %.0f s (%s)",
            len(left),
            self.run_id,
            ", ".join(map(str, sorted(left))),
            timeout,
            source,
        )
        earlier.terminate()
        deadline = time.monotonic() + timeout
        while earlier.alive() and not self.signals and time.monotonic() < deadline:
            self._sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))
        if earlier.alive():
            earlier.kill()
        earlier.remove_cgroups()
        if earlier.alive():
            logger.error(
                "preemptible: processes %s of an earlier attempt survive SIGKILL",
                ", ".join(map(str, sorted(earlier.alive()))),
            )

    def _loop(self) -> int:
        code = 0
        while True:
            if self.signals:
                logger.warning("preemptible: told to stop before the next attempt; exiting")
                return code if self.attempts else signal_exit_code(self.signals[0].signum)
            attempt = self._attempt(self._next_number())
            code = attempt.exit_code
            delay = self._restart_delay(attempt)
            if delay is None:
                self._say_end(attempt)
                return code
            logger.info("preemptible: restarting in %.1f s", delay)
            deadline = time.monotonic() + delay
            while not self.signals and time.monotonic() < deadline:
                self._sleep(deadline - time.monotonic())

    def _restart_delay(self, attempt: Attempt) -> float | None:
        """None when the run ends with this attempt; else seconds before the next one."""
        if attempt.state in (RunState.FINISHED, RunState.KILLED):
            return None
        if attempt.state is RunState.PREEMPTED and self.parent is not None:
            return None  # a nested run: its parent restarts or requeues, as it decides
        if attempt.state is RunState.PREEMPTED and _slurm.in_batch_job():
            _slurm.requeue()  # the requeued job continues this run (same id, same checkpoints)
            return None
        if self.signals:
            return None  # told to stop: no restart on a machine that is going away
        return self.policy.delay_after(self.attempts)

    def _next_number(self) -> int:
        numbers = [
            int(p.name.split("-", 1)[1])
            for p in self.run_dir.glob("attempt-*")
            if _decimal(p.name.split("-", 1)[1])
        ]
        return max(numbers, default=0) + 1

    # -- one attempt -----------------------------------------------------------------------
    def _attempt(self, number: int) -> Attempt:
        first = len(self.signals)  # signals from here on belong to this attempt
        attempt_dir, group = self._start(number)
        done = False
        try:
            gone = self._supervise(number, group, first)
            self._group = None
            attempt = self._finish(number, attempt_dir, group, first, gone)  # recorded first
            left = group.stop_leftovers(self.config.linger, self._sleep)
            if left:
                logger.warning(
                    "preemptible: stopped %d process(es) the job left running outside its "
                    "process group (pids %s)",
                    len(left),
                    ", ".join(map(str, left)),
                )
            done = True
        finally:
            self._group = None
            group.close(done=done)  # not done: the guardian kills what is left
        return attempt

    def _start(self, number: int) -> tuple[Path, ProcessGroup]:
        attempt_dir = self.run_dir / f"attempt-{number}"
        env = self._environment(number, attempt_dir)
        try:
            attempt_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PreemptibleError(f"cannot create {attempt_dir}: {exc.strerror or exc}") from exc
        try:
            group = ProcessGroup(
                self.config.command,
                env=env,
                containment=self.containment,
                cgroup_name=cgroup_name(self.run_id, number),
                lock_fd=self._lock_fd,
            )
        except OSError as exc:
            with contextlib.suppress(OSError):
                attempt_dir.rmdir()  # no attempt took place: leave no trace of one
            raise PreemptibleError(
                f"cannot start {self.config.command[0]!r}: {exc.strerror or exc}"
            ) from exc
        self._group = group
        while self._pending:
            group.signal(self._pending.pop(0))
        self._write_pid_file(group.pid)
        logger.info(
            "preemptible: attempt %d of run %s started: pid %d%s",
            number,
            self.run_id,
            group.pid,
            f", resuming from {env['PREEMPTIBLE_RESUME_FROM']}"
            if "PREEMPTIBLE_RESUME_FROM" in env
            else "",
        )
        return attempt_dir, group

    def _environment(self, number: int, attempt_dir: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PREEMPTIBLE_RUN_ID=self.run_id,
            PREEMPTIBLE_ATTEMPT=str(number),
            PREEMPTIBLE_RUN_DIR=str(attempt_dir.resolve()),
            PREEMPTIBLE_CHECKPOINT_DIR=str(self.checkpoint_dir.resolve()),
        )
        # Not given: the handler may keep its own directory without a warning. A nested run
        # that took its parent's default directory from the environment passes that on.
        inherited = os.environ.get("PREEMPTIBLE_CHECKPOINT_DIR_DEFAULT") == "1" and (
            str(self.checkpoint_dir) == os.environ.get("PREEMPTIBLE_CHECKPOINT_DIR")
        )
        if self.config.checkpoint_dir is None or (self.parent is not None and inherited):
            env["PREEMPTIBLE_CHECKPOINT_DIR_DEFAULT"] = "1"
        else:
            env.pop("PREEMPTIBLE_CHECKPOINT_DIR_DEFAULT", None)
        env.pop("PREEMPTIBLE_RESUME_FROM", None)
        env.update(self.config.extra_env)
        exits = measured_exits(self.run_dir / JOURNAL_NAME)
        if exits:
            # the worst of the last few: one fast exit must not shrink the budget of the next
            env[EXIT_SECONDS_ENV] = f"{max(exits):.3f}"
        try:
            latest = self._resume_target()
        except OSError as exc:
            raise PreemptibleError(
                f"cannot read the checkpoint directory {self.resume_dir}: {exc.strerror or exc}"
            ) from exc
        if latest is not None:
            env["PREEMPTIBLE_RESUME_FROM"] = str(latest.resolve())
        return env

    def _resume_target(self) -> Path | None:
        """The checkpoint the next attempt resumes from: the newest ``step-N.ckpt`` of the
        resume directory, or the one the job's record names (a framework's own name, such as
        Lightning's ``resume.ckpt``) when it is newer."""
        latest = CheckpointStore(self.resume_dir).latest()
        named = self._named_resume
        if named is not None and not (named[1].is_file() or named[1].is_dir()):
            named = None
        if named is not None and (latest is None or named[0] > latest.step):
            return named[1]
        return None if latest is None else latest.path

    def _supervise(self, number: int, group: ProcessGroup, first: int) -> float:
        """Wait for the attempt's whole group; escalate, watch for escapees, beat. Returns
        when (wall time) the group's last process was reaped: a SIGCHLD wakes the wait."""
        plan = _Escalation()
        next_beat = next_watch = 0.0
        while not group.reap():
            now = time.monotonic()
            self._log_signals(first)
            replaced = group.keep_guardian()
            if replaced is not None and replaced[2] is not None:
                logger.warning(
                    "preemptible: the guardian of attempt %d (pid %d) died (%s); started "
                    "another (pid %d)",
                    number,
                    replaced[0],
                    _ending_of(replaced[1]),
                    replaced[2],
                )
            elif replaced is not None:
                logger.error(
                    "preemptible: the guardian of attempt %d cannot run here (it ended with %s "
                    "%d times); the attempt goes on without it: a kill -9 of this supervisor "
                    "would leave its processes running",
                    number,
                    _ending_of(replaced[1]),
                    MAX_GUARDIAN_CRASHES + 1,
                )
            self._escalate(plan, group, self.signals[first:], now)
            if now >= next_watch:
                for pgid in sorted(group.watch()):
                    logger.info(
                        "preemptible: the job started process group %d outside its own; it is "
                        "stopped when the attempt ends",
                        pgid,
                    )
                next_watch = now + WATCH_INTERVAL
            if now >= next_beat:
                self._heartbeat(state="running", attempt=number, child_pid=group.pid)
                next_beat = now + self.config.heartbeat_interval
            wake = min(next_beat, next_watch, plan.next_at())
            self._sleep(min(max(wake - now, 0.0), 1.0))
        gone = time.time()
        self._log_signals(first)
        return gone

    def _escalate(
        self, plan: _Escalation, group: ProcessGroup, mine: list[Received], now: float
    ) -> None:
        """The module docstring's rules: SIGKILL a term timeout after a stop; TERM, then KILL
        what the main process left in its group when no stop was passed on."""
        if not plan.killed and any(s.signum == signal.SIGKILL for s in mine):
            # stop_job's SIGKILL (a lost lease, cancel --now) went to the group from another
            # thread; here, in the main loop, it reaches the processes outside it too
            plan.killed = True
            group.kill_all()
        if mine and plan.kill_at is None:
            plan.timeout, source = self.term_timeout()
            plan.kill_at = now + plan.timeout
            logger.info(
                "preemptible: %s %s the job; SIGKILL in %.0f s if it has not exited (%s)",
                _name(mine[0].signum),
                "passed on to" if mine[0].forwarded else "received; not passed to",
                plan.timeout,
                source,
            )
        if plan.kill_at is not None and now >= plan.kill_at:
            logger.error(
                "preemptible: the job is still running %.0f s after the stop signal; "
                "sending SIGKILL to all of its processes",
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
            wait = self.config.linger
            plan.linger = [(now + wait, signal.SIGTERM), (now + 2 * wait, signal.SIGKILL)]
        while plan.linger and now >= plan.linger[0][0]:
            sig = plan.linger.pop(0)[1]
            logger.warning(
                "preemptible: the job's main process ended (%s) but processes it started in "
                "its group are still running %.0f s later; sending them %s",
                group.ending.describe() if group.ending else "?",
                now - (plan.leader_gone or now),
                _name(sig),
            )
            group.signal(sig)

    def _finish(
        self, number: int, attempt_dir: Path, group: ProcessGroup, first: int, gone: float
    ) -> Attempt:
        ending = group.ending or Ending(lost=True)
        record = load_record(attempt_dir)
        mine = self.signals[first:]
        forwarded = next((s.signum for s in mine if s.forwarded), None)
        state = classify(
            ending, record, first_signal_at=mine[0].at if mine else None, forwarded=forwarded
        )
        code = exit_code_for(state, ending, record, mine[0].signum if mine else None)
        attempt = Attempt(number, group.pid, state, ending, code, group.duration, mine)
        attempt.exit_seconds = exit_seconds(attempt_dir, gone, group.duration)
        self.attempts.append(attempt)
        self._journal(attempt)
        self._follow_checkpoints(record)
        # one line: the state, how the job's own process ended (its exit code, not ours: that
        # is in _say_end's line), and where its training got to
        step = "?" if record.step is None else record.step
        where = ""
        if record.stopped_early or record.state == "save_failed":
            saved = record.checkpoint or f"none (the newest is {self._newest_name()})"
            where = f", stopped at step {step}, checkpoint {saved}"
        elif record.state == "finished" and state is not RunState.FINISHED:
            # a stop that came after the loop ended (the handler is gone): the process died
            # by it, but its training is committed
            newest = self._newest_name()
            where = f"; its training had finished at step {step}, checkpoint {newest}"
        logger.log(
            logging.INFO if state is RunState.FINISHED else logging.WARNING,
            "preemptible: attempt %d: %s (%s) after %.1f s, pid %d%s",
            number,
            state,
            ending.describe(),
            group.duration,
            group.pid,
            where,
        )
        return attempt

    def _say_end(self, attempt: Attempt) -> None:
        """The run ends with ``attempt`` (no restart): the supervisor's exit code and what
        continues the run. Nothing after FINISHED: the attempt's line says it all."""
        if attempt.state is RunState.FINISHED:
            return
        newest = self._newest_name()
        if self.parent is not None:
            then = "the outer run decides what comes next"
        elif newest in ("none", "unknown"):
            then = "no checkpoint to resume from"
        elif attempt.state is RunState.PREEMPTED and _slurm.in_batch_job():
            then = f"the requeued job resumes it from {newest}"
        else:
            then = f"the same command again resumes it from {newest}"
        logger.warning(
            "preemptible: run %s ends %s, exit code %d; %s",
            self.run_id,
            attempt.state,
            attempt.exit_code,
            then,
        )

    def _tell_parent(self) -> None:
        """A nested run ends: its last attempt's record becomes the record of the parent's
        attempt (``PREEMPTIBLE_RUN_DIR``), so that the parent classifies what really happened
        (a preemption, not a bare exit code) and resumes from the same checkpoints."""
        last = self.run_dir / f"attempt-{self.attempts[-1].number}"
        record = {k: v for k, v in read_record(last).items() if k in PASSED_UP}
        parent_dir = Path(os.environ.get("PREEMPTIBLE_RUN_DIR", ""))
        if not parent_dir.is_absolute() or not parent_dir.is_dir():
            return
        record.update(nested_run=self.run_id, pid=os.getpid(), updated_at=time.time())
        path = parent_dir / RECORD_NAME
        try:
            write_text_atomic(path, json.dumps(record, indent=1), durable=True)
        except OSError as exc:
            self._warn_once("parent record", path, exc)

    def _newest_name(self) -> str:
        """The checkpoint the next attempt would resume from, for a log line."""
        try:
            latest = self._resume_target()
        except (OSError, PreemptibleError):
            return "unknown"
        return "none" if latest is None else latest.name

    def _follow_checkpoints(self, record: RunRecord) -> None:
        """Resume from where the job says it saves (its handler may have a directory of its
        own), when that is an existing directory; else keep the supervisor's. The newest
        checkpoint it names counts when it lies in that directory."""
        if record.resume_from is not None and record.checkpoint_dir is not None:
            named = Path(record.resume_from)
            if named.is_absolute() and named.parent == Path(record.checkpoint_dir):
                self._named_resume = (record.resume_step or 0, named)
        if record.checkpoint_dir is None:
            return
        where = Path(record.checkpoint_dir)
        if not where.is_absolute() or not where.is_dir():
            return
        if where.resolve() == self.resume_dir.resolve():
            return  # the same directory (--checkpoint-dir ckpt, the job's ckpt/)
        logger.info(
            "preemptible: the job keeps its checkpoints in %s, not in %s", where, self.resume_dir
        )
        self.resume_dir = where

    def term_timeout(self) -> tuple[float, str]:
        return term_timeout(self.config.term_timeout)

    # -- files of the run: journal, heartbeat, pid file --------------------------------------
    def _warn_once(self, what: str, path: Path, exc: OSError) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(
                "preemptible: cannot write %s (%s); the run goes on without it",
                path,
                exc.strerror or exc,
            )

    def _journal(self, attempt: Attempt) -> None:
        path = self.run_dir / JOURNAL_NAME
        try:
            fd = open_in_place(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            with os.fdopen(fd, "a") as fh:
                fh.write(json.dumps(attempt.as_json()) + "\n")
        except OSError as exc:
            self._warn_once("journal", path, exc)

    def _heartbeat(self, **fields: Any) -> None:
        path = self.run_dir / "heartbeat.json"
        beat = {**fields, "pid": os.getpid(), "run_id": self.run_id, "at": time.time()}
        try:
            write_text_atomic(path, json.dumps(beat))
        except OSError as exc:
            self._warn_once("heartbeat", path, exc)

    def _heartbeat_final(self) -> None:
        """Readers must not take a finished run's last beat for a live one."""
        last = self.attempts[-1] if self.attempts else None
        self._heartbeat(
            state="ended",
            attempt=last.number if last else None,
            run_state=str(last.state) if last else None,
            exit_code=self._exit_code,
        )

    def _write_pid_file(self, pid: int) -> None:
        path = self.config.pid_file
        if path is None:
            return
        text = f"{pid}\n"
        try:
            write_text_atomic(path, text)
            self._pid_text = text
        except OSError as exc:
            self._warn_once("pid file", path, exc)

    def _remove_pid_file(self) -> None:
        """Only while it still holds our pid: another process may have taken the name."""
        path = self.config.pid_file
        if path is None or self._pid_text is None:
            return
        with contextlib.suppress(OSError, ValueError):
            if path.read_text() == self._pid_text:
                path.unlink()


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
    except ConfigError as exc:
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


def exit_seconds(attempt_dir: Path, gone: float, duration: float) -> float | None:
    """Seconds from the attempt's final commit (its record's ``committed_at``) to ``gone``,
    when its last process was reaped: the way out (watcher, acknowledgements, tracker,
    interpreter and torch shutdown) that the process cannot time itself. None without a
    final commit, or when the record's time cannot be this attempt's (it is the job's
    input: a bad one must not set the next attempt's budget)."""
    record = read_record(attempt_dir)
    committed = _time(record.get("committed_at"))
    if record.get("state") != "stopped" or committed is None:
        return None
    seconds = gone - committed
    return seconds if 0 <= seconds <= duration else None


def measured_exits(journal: Path) -> list[float]:
    """The exit times of the last ``EXIT_HISTORY`` attempts that measured one, oldest first.
    Read from the journal, so that a supervisor started again (a requeued SLURM job, a
    rerun of the same command) knows the run's earlier attempts too."""
    found: list[float] = []
    for line in reversed(_tail(journal, JOURNAL_TAIL_BYTES)):
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            continue
        value = _time(entry.get("exit_s")) if isinstance(entry, dict) else None
        if value is not None and value >= 0:
            found.append(value)
            if len(found) == EXIT_HISTORY:
                break
    return found[::-1]


def _decimal(text: str) -> bool:
    """ASCII digits only: ``str.isdigit()`` also takes "²", which ``int()`` refuses."""
    return text.isascii() and text.isdigit()


def _ending_of(returncode: int) -> str:
    """A Popen return code in words."""
    if returncode < 0:
        return Ending(signal=-returncode).describe()
    return Ending(exit_code=returncode).describe()


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _check_writable(path: Path, option: str) -> None:
    """Fail before the job starts, not when its pid is to be written."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise ConfigError(
            f"{option} {path}: cannot write in {path.parent} ({exc.strerror or exc}); give a "
            "file in an existing, writable directory"
        ) from exc


def _take_lock(fd: int, run_id: str) -> None:
    """``flock`` the run, waiting up to ``LOCK_WAIT`` while the holder is a supervisor that is
    gone: its guardian holds the lock until it has stopped that supervisor's attempt, and the
    next attempt must not meet those processes."""
    deadline = time.monotonic() + LOCK_WAIT
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            if not _decimal(holder) or _alive(int(holder)) or time.monotonic() >= deadline:
                raise
            if not told:
                told = True
                logger.info(
                    "preemptible: run %s: its last supervisor (pid %s) is gone; waiting for its "
                    "guardian to stop that attempt's processes",
                    run_id,
                    holder,
                )
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Running (a zombie is not: its parent has just not collected it yet)."""
    proc = read_proc(pid)
    return proc is not None and not proc.zombie


def _lock_run(run_dir: Path, run_id: str) -> int:
    """Hold the run's lock (an advisory ``flock``, released when the fd closes, also when the
    supervisor is killed); not inherited by the job (``O_CLOEXEC``)."""
    path = run_dir / LOCK_NAME
    try:
        fd = open_in_place(path, os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        raise PreemptibleError(f"cannot open {path}: {exc.strerror or exc}") from exc
    try:
        _take_lock(fd, run_id)
    except BlockingIOError as exc:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        who = f"pid {holder}" if _decimal(holder) else "another process"
        raise RunLockedError(
            f"run {run_id} is already supervised by {who} ({path}); wait for it to end, or "
            "pass another --run-id"
        ) from exc
    except OSError as exc:  # a file system without locks
        os.close(fd)
        raise PreemptibleError(f"cannot lock {path}: {exc.strerror or exc}") from exc
    with contextlib.suppress(OSError):  # the pid is only for the message above
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
