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
passed on, and the trainer exits at once (``_forwarding.py``).

The rest of the supervisor's concerns have modules of their own: the run id (``_runid.py``),
its configuration (``_config.py``), the run's lock (``_lock.py``), the attempts and their
journal (``_journal.py``), the files it writes for others (``_runfiles.py``), deadlines and
escalation (``_deadlines.py``), the restart policy (``_policy.py``), where the next attempt
resumes from (``_resume.py``), what each attempt is told and what a nested run passes up
(``_attempt_env.py``), and stopping what earlier attempts left running (``_earlier.py``).
The names of a run's files are in ``preemptible._paths``.

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
when their supervisor and guardian were killed together (``_earlier.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from .._errors import PreemptibleError
from .._paths import OWNER_NAME, RunPaths, read_journal, read_json_object
from .._run import current_run
from .._states import HeartbeatState, RecordState, RunState
from ..stop._termination import signal_exit_code
from . import _slurm
from ._attempt_env import attempt_environment, check_bucket, check_inherited_env, tell_parent
from ._cgroup import Containment, cgroup_name, choose, remove_stale
from ._classify import Ending, classify, exit_code_for
from ._config import SupervisorConfig
from ._deadlines import Escalation, escalate, kill_after, term_timeout
from ._earlier import stop_earlier_attempts
from ._forwarding import Forwarder
from ._journal import JOURNAL_TAIL_BYTES, Attempt, Received, exit_seconds
from ._lock import lock_run
from ._parent import find_parent, mark_attempt
from ._policy import RestartPolicy
from ._process import MAX_GUARDIAN_CRASHES, Lease, ProcessGroup, become_subreaper
from ._record import load_record
from ._resume import Resumes
from ._runfiles import RunFiles
from ._runid import default_run_id

logger = logging.getLogger("preemptible")

WATCH_INTERVAL = 2.0  # seconds between looks for processes that left the job's group
_told_own_run = False  # the line below, once per process (an agent makes a supervisor a run)


def _own_run(config: SupervisorConfig, why: str) -> SupervisorConfig:
    """The environment names an attempt this process is not part of (a leftover): a run of
    its own, which writes nothing there and does not take that attempt's checkpoints."""
    global _told_own_run
    dropped = config.checkpoint_dir_from_env and config.checkpoint_dir is not None
    if not _told_own_run:
        _told_own_run = True
        logger.warning(
            "preemptible: PREEMPTIBLE_RUN_DIR=%s is not an attempt this process is part of "
            "(%s; a leftover in the environment?): this is a run of its own, and nothing is "
            "written there%s",
            current_run().run_dir,
            why,
            "; PREEMPTIBLE_CHECKPOINT_DIR, that attempt's, is not used either" if dropped else "",
        )
    return dataclasses.replace(config, checkpoint_dir=None) if dropped else config


class Supervisor:
    def __init__(self, config: SupervisorConfig) -> None:
        _slurm.in_batch_job()  # a bad SLURM job id fails here, before anything starts
        # a nested run: the run whose attempt started this one (proven: _parent.py)
        self.parent, not_ours = find_parent()
        if not_ours:
            config = _own_run(config, not_ours)
        self.config = config
        parent_id = self.parent.run_id if self.parent is not None else None
        if config.run_id is not None:
            self.run_id, self._run_id_why = config.run_id, ""
        else:
            self.run_id, self._run_id_why = default_run_id(
                config.command, config.checkpoint_dir, parent_id
            )
        self.paths = RunPaths.under(config.home, self.run_id)
        self.run_dir = self.paths.run_dir
        self.checkpoint_dir = config.checkpoint_dir or self.paths.checkpoints
        # where the job really saves (its record's checkpoint_dir); resumes come from here
        self.resumes = Resumes(self.checkpoint_dir)
        self.forwarding = Forwarder(forward=config.forward_signals, job_control=config.job_control)
        self.files = RunFiles(self.paths, self.run_id, config.pid_file)
        self.attempts: list[Attempt] = []
        self.policy = RestartPolicy(config)
        self._lock_fd = -1
        self._exit_code: int | None = None
        self.containment: Containment | None = None
        self._made_checkpoint_dir = False  # by _prepare: removed at the end when left empty

    @property
    def signals(self) -> list[Received]:
        """The signals received since the supervisor started (``stop_job``'s too)."""
        return self.forwarding.signals

    @property
    def requested(self) -> list[Received]:
        """Of ``signals``, the stops asked for by ``stop_job``."""
        return self.forwarding.requested

    @property
    def resume_dir(self) -> Path | str:
        """Where the job really saves (its record's checkpoint_dir): resumes come from here."""
        return self.resumes.directory

    def _sleep(self, seconds: float) -> None:
        self.forwarding.sleep(seconds)

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> int:
        """Attempts until the run ends (the restart policy); the exit code of the last."""
        with self._session():
            self._journal_lost_attempt()
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
        group = self.forwarding.group
        return None if group is None else group.pid

    def receive(self, signum: int) -> None:
        """A stop signal that reached this process before the supervisor's handlers were
        installed (``preemptible agent``'s handler hands it over while the attempt starts):
        received, passed on once the job has started, and the attempt's."""
        self.forwarding.receive(signum)

    @property
    def fenced(self) -> bool:
        """Whether the running attempt's guardian stops it by the agent's lease file (the
        agent's watchdog then leaves the lease's signals to it: ``_guard.Fence``)."""
        group = self.forwarding.group
        return group is not None and group.fencing

    def stop_job(self, signum: int) -> None:
        """Stop the running attempt as a received ``signum`` would, from another thread (a
        sweep's cancel; SIGKILL for a lost lease or ``cancel --now``): passed on to the group,
        then the escalation. Listed in ``requested`` too, to tell it from a real signal."""
        self.forwarding.request(signum)

    @contextlib.contextmanager
    def _session(self) -> Iterator[None]:
        self._prepare()
        become_subreaper()
        self.forwarding.install()
        try:
            self._stop_earlier_attempts()
            yield
        finally:
            self.forwarding.uninstall()
            self._heartbeat_final()
            self.files.remove_pid()
            self._drop_unused_checkpoint_dir()
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # releases the run's lock

    def _drop_unused_checkpoint_dir(self) -> None:
        """The checkpoint directory this run made for its attempts, left empty (the job keeps
        its checkpoints in a directory of its own, a Trainer's output_dir): removed, so that
        it does not look like a run whose checkpoints were lost. A rerun makes it again."""
        if self._made_checkpoint_dir and isinstance(self.checkpoint_dir, Path):
            with contextlib.suppress(OSError):
                self.checkpoint_dir.rmdir()  # only an empty directory

    def _prepare(self) -> None:
        """Everything that can fail on bad input, before any job starts: one line each."""
        check_inherited_env()
        if isinstance(self.checkpoint_dir, str):  # a bucket's URL
            check_bucket(self.checkpoint_dir)
        self.files.check_pid_file()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PreemptibleError(
                f"cannot create the run directory {self.run_dir}: {exc.strerror or exc}; "
                "give --home (PREEMPTIBLE_HOME) a writable directory"
            ) from exc
        # the attempts are told this directory (PREEMPTIBLE_CHECKPOINT_DIR): it exists when
        # they start, as it always has; made here, on purpose, not by the resume lookup, which
        # only reads. One that cannot be made is the job's to report, with its own message.
        self._made_checkpoint_dir = False
        if isinstance(self.checkpoint_dir, Path):  # a bucket's URL: the attempts stage it
            self._made_checkpoint_dir = not self.checkpoint_dir.exists()
            with contextlib.suppress(OSError):
                self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        earlier = self.paths.attempt_numbers()
        if earlier:  # a rerun of the command: what the run's last attempt said is known
            self.resumes.said_before(load_record(self.paths.attempt(max(earlier))))
        self.containment = choose()
        if self.containment.parent is not None:
            remove_stale(self.containment.parent)
        logger.debug("preemptible: attempts are contained by %s", self.containment.describe())
        self._lock_fd = lock_run(self.run_dir, self.run_id)  # last: nothing fails after it
        if self._run_id_why:
            logger.info(
                "preemptible: run %s (%s); a rerun of the same command continues this run; "
                "pass --run-id to start another",
                self.run_id,
                self._run_id_why,
            )

    def _stop_earlier_attempts(self) -> None:
        """Stop what earlier attempts of this run left running (their supervisor and guardian
        were killed together): ``_earlier.py``."""
        stop_earlier_attempts(
            self.run_dir,
            self.run_id,
            term_timeout=self.term_timeout,
            stopped=lambda: bool(self.signals),
            sleep=self._sleep,
        )

    def _journal_lost_attempt(self) -> None:
        """The run's last attempt, when its supervisor died without a word (SIGKILL, its
        machine gone) and never journaled it: journaled now, its processes stopped, as lost
        (CRASHED, or PREEMPTED when it had marked itself preempting at its start: ``_classify``),
        so that the run's history and ``preemptible runs`` count it. Its duration runs from its
        start to the dead supervisor's last heartbeat of it. Not under a sweep agent
        (``run_attempt``): there the queue says how an attempt ended, and a frozen agent's
        supervisor may yet journal its own."""
        earlier = self.paths.attempt_numbers()
        if not earlier:
            return
        number = max(earlier)
        journal = read_journal(self.paths.journal, JOURNAL_TAIL_BYTES)
        if any(entry.get("attempt") == number for entry in journal):
            return
        attempt_dir = self.paths.attempt(number)
        record, ending = load_record(attempt_dir), Ending(lost=True)
        state = classify(ending, record, first_signal_at=None, stops=set(), killed=False)
        beat = read_json_object(self.paths.heartbeat, 1 << 14)
        if beat.get("attempt") != number:  # the last beat was of another attempt: no use here
            beat = {}
        duration = 0.0
        with contextlib.suppress(OSError, KeyError, TypeError, ValueError):
            started = (attempt_dir / OWNER_NAME).stat().st_mtime
            duration = min(max(float(beat["at"]) - started, 0.0), 10.0**8)
        pid = beat.get("child_pid")
        pid = pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else 0
        code = exit_code_for(state, ending, record, None)
        self.files.journal(Attempt(number, pid, state, ending, code, duration))
        logger.warning(
            "preemptible: attempt %d of run %s ended unseen (its supervisor was killed "
            "before it could say how): journaled as %s",
            number,
            self.run_id,
            state,
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
        return max(self.paths.attempt_numbers(directories_only=False), default=0) + 1

    # -- one attempt -----------------------------------------------------------------------
    def _attempt(self, number: int) -> Attempt:
        # signals from here on belong to this attempt, and those that came while it was being
        # prepared (``_stop_earlier_attempts``, an agent's hand-over): they are passed on to it
        first = self.forwarding.waiting_from
        attempt_dir, group = self._start(number)
        done = False
        try:
            gone, killed = self._supervise(number, group, first)
            self.forwarding.group = None
            attempt = self._finish(number, attempt_dir, group, first, gone, killed)  # recorded
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
            self.forwarding.group = None
            group.close(done=done)  # not done: the guardian kills what is left
        return attempt

    def _start(self, number: int) -> tuple[Path, ProcessGroup]:
        attempt_dir = self.paths.attempt(number)
        env = self._environment(number, attempt_dir)
        try:
            attempt_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PreemptibleError(f"cannot create {attempt_dir}: {exc.strerror or exc}") from exc
        try:  # before the job starts: a run nested in it looks for this first
            mark_attempt(attempt_dir, self.run_id, number)
        except OSError as exc:
            self.files.warn_once("attempt owner", attempt_dir / OWNER_NAME, exc)
        try:
            group = ProcessGroup(
                self.config.command,
                env=env,
                containment=self.containment,
                cgroup_name=cgroup_name(self.run_id, number),
                lock_fd=self._lock_fd,
                lease=self._lease(),
            )
        except OSError as exc:
            with contextlib.suppress(OSError):  # no attempt took place: leave no trace of one
                (attempt_dir / OWNER_NAME).unlink(missing_ok=True)
                attempt_dir.rmdir()
            raise PreemptibleError(
                f"cannot start {self.config.command[0]!r}: {exc.strerror or exc}"
            ) from exc
        self.forwarding.attach(group)
        self.files.write_pid(group.pid)
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

    def _lease(self) -> Lease | None:
        if self.config.lease_file is None:
            return None
        return Lease(self.config.lease_file, self.term_timeout()[0], self.run_id)

    def _environment(self, number: int, attempt_dir: Path) -> dict[str, str]:
        return attempt_environment(
            number,
            attempt_dir,
            run_id=self.run_id,
            config=self.config,
            checkpoint_dir=self.checkpoint_dir,
            nested=self.parent is not None,
            journal=self.paths.journal,
            resumes=self.resumes,
            kill_after=kill_after(self.config.term_timeout),
        )

    def _supervise(self, number: int, group: ProcessGroup, first: int) -> tuple[float, bool]:
        """Wait for the attempt's whole group; escalate, watch for escapees, beat. Returns
        when (wall time) the group's last process was reaped (a SIGCHLD wakes the wait), and
        whether the supervisor SIGKILLed the attempt itself (``Escalation.killed``)."""
        plan = Escalation()
        next_beat = next_watch = 0.0
        while not group.reap():
            now = time.monotonic()
            self.forwarding.log_since(first)
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
            escalate(
                plan,
                group,
                self.signals[first:],
                now,
                term_timeout=self.term_timeout,
                linger=self.config.linger,
            )
            if now >= next_watch:
                for pgid in sorted(group.watch()):
                    logger.info(
                        "preemptible: the job started process group %d outside its own; it is "
                        "stopped when the attempt ends",
                        pgid,
                    )
                next_watch = now + WATCH_INTERVAL
            if now >= next_beat:
                self.files.heartbeat(
                    state=HeartbeatState.RUNNING, attempt=number, child_pid=group.pid
                )
                next_beat = now + self.config.heartbeat_interval
            wake = min(next_beat, next_watch, plan.next_at())
            self._sleep(min(max(wake - now, 0.0), 1.0))
        gone = time.time()
        self.forwarding.log_since(first)
        return gone, plan.killed

    def _finish(
        self,
        number: int,
        attempt_dir: Path,
        group: ProcessGroup,
        first: int,
        gone: float,
        killed: bool,
    ) -> Attempt:
        """Classify the attempt (``_classify``: the stops received or asked for during it, and
        whether the supervisor SIGKILLed it, are the supervisor's own knowledge), journal it,
        say it in one line."""
        ending = group.ending or Ending(lost=True)
        record = load_record(attempt_dir)
        mine = self.signals[first:]
        state = classify(
            ending,
            record,
            first_signal_at=mine[0].at if mine else None,
            stops={s.signum for s in mine},
            killed=killed,
        )
        code = exit_code_for(state, ending, record, mine[0].signum if mine else None)
        attempt = Attempt(number, group.pid, state, ending, code, group.duration, mine, killed)
        attempt.exit_seconds = exit_seconds(attempt_dir, gone, group.duration)
        self.attempts.append(attempt)
        self.files.journal(attempt)
        self.resumes.follow(record)
        # one line: the state, how the job's own process ended (its exit code, not ours: that
        # is in _say_end's line), and where its training got to
        step = "?" if record.step is None else record.step
        where = ""
        if record.stopped_early or record.state is RecordState.SAVE_FAILED:
            saved = record.checkpoint or f"none (the newest is {self.resumes.newest_name()})"
            where = f", stopped at step {step}, checkpoint {saved}"
        elif record.state is RecordState.FINISHED and state is not RunState.FINISHED:
            # a stop that came after the loop ended (the handler is gone): the process died
            # by it, but its training is committed
            newest = self.resumes.newest_name()
            where = f"; its training had finished at step {step}, checkpoint {newest}"
        elif state is RunState.PREEMPTED and record.state is None:
            # the stop landed where no handler of ours acted on it: in the program's start-up,
            # or in a program without one
            newest = self.resumes.newest_name()
            where = (
                "; nothing saved for the stop (no handler at a step boundary); newest "
                f"checkpoint: {newest}"
            )
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
        newest = self.resumes.newest_name()
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
        """A nested run ends: its last attempt's record is passed up (``tell_parent``)."""
        assert self.parent is not None
        last = self.paths.attempt(self.attempts[-1].number)
        tell_parent(self.run_id, last, self.parent.attempt_dir, self.files)

    def term_timeout(self) -> tuple[float, str]:
        return term_timeout(self.config.term_timeout)

    def _heartbeat_final(self) -> None:
        """Readers must not take a finished run's last beat for a live one."""
        last = self.attempts[-1] if self.attempts else None
        self.files.heartbeat(
            state=HeartbeatState.ENDED,
            attempt=last.number if last else None,
            run_state=str(last.state) if last else None,
            exit_code=self._exit_code,
        )


def _ending_of(returncode: int) -> str:
    """A Popen return code in words."""
    if returncode < 0:
        return Ending(signal=-returncode).describe()
    return Ending(exit_code=returncode).describe()
