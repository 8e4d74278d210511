"""One attempt's processes: a child in its own process group, reaped to the last member, and
whatever it leaves behind stopped, wherever it went.

The job starts in a new session (so a process group led by it, which gets the forwarded
signals). Processes can leave that group (a daemon that calls ``setsid()``; torchrun starts
each worker with ``start_new_session=True``), so the attempt is more than its group:

- in a cgroup v2 of its own (``_cgroup.py``) where the machine lets us: the kernel lists every
  process of the attempt, and ``cgroup.kill`` ends them all;
- else the processes found through ``/proc`` (``_guard.Tracker``): the job's descendants and
  the orphans the supervisor adopts as a child subreaper (``PR_SET_CHILD_SUBREAPER``: a
  process whose parent dies is re-parented to the supervisor instead of init, so a wrapper
  shell that dies from a forwarded signal leaves its training child in reach).

The guardian (``_guard.py``) does the same tracking on its own, every 50 ms, in a session of its
own, so that it knows torchrun's workers before the supervisor can die; when the supervisor
dies without saying ``done`` (SIGKILL included), it kills them all. A dead guardian is replaced
at once (``keep_guardian``). It also holds the run's lock: a new supervisor of the run waits
until the guardian has finished, so the next attempt never meets the last one's processes.
When the supervisor and its guardian die together, the next supervisor of the run stops what
is left (``EarlierAttempts``) before its first attempt starts. Every process of an attempt
carries the attempt's ``PREEMPTIBLE_RUN_DIR`` and ``PREEMPTIBLE_ATTEMPT_TOKEN`` in its
environment, which finds those that left the tree before anyone saw them.

Children the supervisor had before the attempt started (an earlier attempt's guardian,
anything the host program started) are never touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from . import _guard
from ._cgroup import AttemptCgroup, Containment, attempt_cgroup_of
from ._classify import Ending

logger = logging.getLogger("preemptible")

_PR_SET_CHILD_SUBREAPER = 36
GUARD_SCRIPT = str(Path(_guard.__file__).resolve())
MAX_GUARDIAN_CRASHES = 3  # guardians that exit by themselves, replaced before giving up


def become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except OSError:  # pragma: no cover - no libc
        return False


def children() -> dict[int, tuple[int, bool]]:
    """This process's children, adopted orphans included: pid -> (pgid, is a zombie)."""
    me = os.getpid()
    return {p.pid: (p.pgid, p.zombie) for p in _guard.processes().values() if p.ppid == me}


TOKEN = "PREEMPTIBLE_ATTEMPT_TOKEN"
_tokens = itertools.count(1)


def new_token() -> str:
    """``PID.START.N``: this supervisor (its pid and start time) and its Nth attempt. Every
    process of the attempt inherits it, and no other attempt, of this run or another, has
    the same one, even where two supervisors were given the same attempt directory (a run
    directory deleted under a supervisor)."""
    me = _guard.read_proc(os.getpid())
    return f"{os.getpid()}.{me.start if me else 0}.{next(_tokens)}"


def token_owner(token: str) -> tuple[int, int] | None:
    """The supervisor (pid, start time) a token names, None if it is no token of ours."""
    parts = token.split(".")
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


class Lease(NamedTuple):
    """An agent's lease on the attempt, for its guardian to fence it by (``_guard.Fence``)."""

    file: Path
    term_timeout: float
    run_id: str


class ProcessGroup:
    """``argv`` started in a new session (and so a new process group led by it), contained
    as ``containment`` says, with a guardian."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path | None = None,
        containment: Containment | None = None,
        cgroup_name: str = "",
        lock_fd: int = -1,
        lease: Lease | None = None,
    ) -> None:
        self.argv = list(argv)
        self.lease = lease
        self.known = set(children())  # not ours to stop when the attempt ends
        self.cgroup = self._make_cgroup(containment, cgroup_name)
        self.token = new_token()
        self.marker = f"{TOKEN}={self.token}"
        self._lock_fd = lock_fd
        try:
            with self.cgroup.entered() if self.cgroup else contextlib.nullcontext():
                self.proc = subprocess.Popen(
                    self.argv,
                    env={**env, TOKEN: self.token},
                    cwd=cwd,
                    start_new_session=True,
                )
        except BaseException:
            if self.cgroup is not None:
                self.cgroup.remove()
            raise
        self.pid = self.pgid = self.proc.pid
        self.started = time.monotonic()
        self.ending: Ending | None = None
        self.escaped: set[int] = set()  # process groups the job started outside its own
        self.guardians: list[int] = []  # pids of this attempt's guardians, the first included
        self._crashes = 0  # guardians that exited by themselves
        self._given_up = False
        self.tracker = _guard.Tracker(supervisor=os.getpid(), job=self.pid)
        try:
            self._guardian = self._start_guardian()
        except BaseException:  # never a job without its guardian
            self.kill_all()
            self.proc.wait()
            if self.cgroup is not None:
                self.cgroup.remove()
            raise

    @staticmethod
    def _make_cgroup(containment: Containment | None, name: str) -> AttemptCgroup | None:
        if containment is None or containment.parent is None or containment.kind != "cgroup":
            return None
        try:
            return AttemptCgroup(containment.parent, name)
        except OSError as exc:
            logger.warning(
                "preemptible: cannot make the attempt's cgroup under %s (%s); this attempt is "
                "contained by the /proc guardian",
                containment.parent,
                exc.strerror or exc,
            )
            return None

    def _start_guardian(self) -> subprocess.Popen[bytes]:
        config = {
            "supervisor": os.getpid(),
            "job": self.pid,
            "protect": sorted({os.getpgrp(), os.getsid(0)}),
            "marker": self.marker,
            "cgroup": str(self.cgroup.path) if self.cgroup else None,
        }
        if self.lease is not None:
            config.update(
                lease=str(self.lease.file),
                term_timeout=self.lease.term_timeout,
                run=self.lease.run_id,
            )
        guardian = subprocess.Popen(
            [sys.executable, "-I", "-S", GUARD_SCRIPT, json.dumps(config)],
            stdin=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
            pass_fds=(self._lock_fd,) if self._lock_fd >= 0 else (),
        )
        self.guardians.append(guardian.pid)
        self.tracker.spare.add(guardian.pid)
        return guardian

    @property
    def fencing(self) -> bool:
        """Whether a guardian stops this attempt by its lease (``_guard.Fence``)."""
        return self.lease is not None and not self._given_up

    def keep_guardian(self) -> tuple[int, int, int | None] | None:
        """A dead guardian replaced: (old pid, its return code, the new one's pid), else
        None. One killed by a signal is always replaced; one that exited by itself (it could
        not run here) a few times, then the attempt goes on without (new pid None, once)."""
        if self._given_up:
            return None
        code = self._guardian.poll()
        if code is None:
            return None
        old = self._guardian.pid
        if code >= 0:
            self._crashes += 1
            if self._crashes > MAX_GUARDIAN_CRASHES:
                self._given_up = True
                return old, code, None
        self._guardian = self._start_guardian()
        return old, code, self._guardian.pid

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to every process of the group; False when nobody is left."""
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            return False
        return True

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to every process of the attempt, in its group or not (SIGSTOP, then
        SIGCONT: the terminal's Ctrl+Z passed on to a job no terminal reaches, ``Forwarder``)."""
        self.signal(sig)
        for pid, start in self.members(full=False).items():
            _guard.signal_process(pid, start, sig)

    def kill_all(self) -> None:
        """SIGKILL every process of the attempt, in its group or not."""
        self.signal(signal.SIGKILL)
        if self.cgroup is not None:
            self.cgroup.kill()
        else:
            _guard.kill_tree(
                self.tracker, markers=[self._marker_bytes()], protect=[os.getpgrp(), os.getsid(0)]
            )

    def _marker_bytes(self) -> bytes:
        return self.marker.encode("utf-8", "surrogateescape")

    def reap(self) -> bool:
        """Collect every member that has exited; True once no member of the group is left."""
        while True:
            try:
                info = os.waitid(os.P_PGID, self.pgid, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                break  # none of our children (incl. adopted orphans) is in the group
            if info is None:
                return False
            if info.si_pid == self.pid:
                self.proc.returncode = 0  # reaped here; keep Popen from waiting again
                if info.si_code == os.CLD_EXITED:
                    self.ending = Ending(exit_code=info.si_status)
                else:
                    self.ending = Ending(signal=info.si_status)
        # Members that are not our children (their own parent is alive) still count.
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return True
        return False

    # -- processes outside the group -------------------------------------------------------
    def _reap_orphans(self, *, full: bool) -> None:
        """Collect adopted orphans of this attempt that have exited (not in the group, so
        ``reap`` does not see them): those the tracker knows, or (``full``) every child."""
        me = os.getpid()
        if full:
            candidates = children()
        else:
            self.tracker.poll()
            candidates = {
                pid: (p.pgid, p.zombie)
                for pid in list(self.tracker.members)
                if (p := _guard.read_proc(pid)) is not None and p.ppid == me
            }
        for pid, (pgid, zombie) in candidates.items():
            if pgid == self.pgid or pid == self.pid:
                continue  # reap() collects these, and the leader's status is the attempt's
            if zombie and pid not in self.known and pid not in self.guardians:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)

    def members(self, *, full: bool = True) -> dict[int, int]:
        """Every running process of the attempt: pid -> start time. ``full``: also those
        found by the attempt's environment entry, which costs a read of every process's
        environment; else only the cgroup's, or the tracker's (a few reads)."""
        if self.cgroup is not None:
            pids = self.cgroup.procs()
        else:
            self.tracker.poll()
            pids = list(self.tracker.members)
        found = {}
        for pid in pids:
            p = _guard.read_proc(pid)
            if p is not None and not p.zombie and self.tracker.members.get(pid, p.start) == p.start:
                found[pid] = p.start
        if full:
            spare = {os.getpid(), *self.guardians}
            table = _guard.processes().values()
            found.update(_guard.marked(table, [self._marker_bytes()], spare=spare))
        for pid in (os.getpid(), *self.guardians):
            found.pop(pid, None)
        return found

    def _leftovers(self, *, full: bool = True) -> dict[int, int]:
        """Running processes of the attempt outside its group: pid -> start time."""
        self._reap_orphans(full=full)
        found = {}
        for pid, start in self.members(full=full).items():
            p = _guard.read_proc(pid)
            if p is not None and p.pgid != self.pgid:
                found[pid] = start
        return found

    def watch(self) -> set[int]:
        """Process groups the job started outside its own, seen for the first time (the log
        says so: they are stopped when the attempt ends). Cheap: it runs every 2 s."""
        groups = {
            p.pgid
            for pid in self._leftovers(full=False)
            if (p := _guard.read_proc(pid)) is not None
        }
        new = groups - self.escaped - {os.getpgrp()}
        self.escaped |= new
        return new

    def stop_leftovers(self, grace: float, sleep: Callable[[float], None]) -> list[int]:
        """SIGTERM what the attempt left outside its group, SIGKILL everything still there
        ``grace`` seconds later; reap them. Returns their pids."""
        deadline = time.monotonic() + grace
        seen: dict[int, int] = {}
        while True:
            left = self._leftovers()
            if not left:
                break
            if time.monotonic() >= deadline:
                seen.update(left)
                self.kill_all()
                if self._leftovers():
                    logger.error(
                        "preemptible: processes %s the job left behind survive SIGKILL; "
                        "giving up on them",
                        sorted(self._leftovers()),
                    )
                break
            for pid, start in left.items():
                if seen.get(pid) != start:
                    seen[pid] = start
                    _guard.signal_process(pid, start, signal.SIGTERM)
            sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))
        self._reap_orphans(full=True)
        return sorted(seen)

    def close(self, *, done: bool = True) -> None:
        """Dismiss the guardian. ``done=False`` (the supervisor is failing with the job still
        running) closes the pipe without the word, and the guardian kills what is left."""
        stdin = self._guardian.stdin
        if stdin is not None:
            with contextlib.suppress(OSError):
                if done:
                    stdin.write(b"done\n")
                stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._guardian.wait(timeout=15 if not done else 5)
        if done and self.cgroup is not None and not self.cgroup.remove():
            logger.warning("preemptible: cannot remove %s: processes are left in it", self.cgroup)

    @property
    def duration(self) -> float:
        return time.monotonic() - self.started


class EarlierAttempts:
    """Processes of earlier attempts of a run that outlived their supervisor *and* its
    guardian (both killed at once): found by the ``PREEMPTIBLE_RUN_DIR`` they inherited, and
    the attempt cgroups they are in. Only a supervisor that holds the run's lock looks, and a
    process whose supervisor (named by its ``PREEMPTIBLE_ATTEMPT_TOKEN``) still runs is not
    one of them: that supervisor was given the same directory (one deleted under it)."""

    def __init__(self, run_dir: Path, run_id: str) -> None:
        self.run_id = run_id
        prefix = f"PREEMPTIBLE_RUN_DIR={run_dir.resolve()}{os.sep}attempt-".encode(
            "utf-8", "surrogateescape"
        )
        procs = _guard.processes()
        self.spare = spare = {os.getpid(), *_ancestors(procs)}
        self.found: dict[int, int] = {}
        self.tokens: set[bytes] = set()
        for pid, start in _guard.marked(procs.values(), [prefix], spare=spare, prefix=True).items():
            token = _token_of(pid)
            owner = token_owner(token) if token else None
            if owner is not None and _running(*owner):
                continue  # supervised: not an orphan
            self.found[pid] = start
            if token:
                self.tokens.add(f"{TOKEN}={token}".encode())
        self.cgroups = {cg for pid in self.found if (cg := attempt_cgroup_of(pid, run_id))}
        for cg in self.cgroups:
            for pid in _guard.cgroup_procs(cg):
                if (p := procs.get(pid)) is not None and pid not in spare and not p.zombie:
                    self.found[pid] = p.start

    def alive(self) -> dict[int, int]:
        return {
            pid: start
            for pid, start in self.found.items()
            if (p := _guard.read_proc(pid)) is not None and p.start == start and not p.zombie
        }

    def terminate(self) -> None:
        for pid, start in self.found.items():
            _guard.signal_process(pid, start, signal.SIGTERM)

    def remove_cgroups(self) -> None:
        for cg in self.cgroups:
            _guard.cgroup_remove(cg)

    def kill(self) -> None:
        for cg in self.cgroups:
            _guard.cgroup_kill(cg)
        _guard.kill_tree(
            None,
            markers=self.tokens,
            known=self.alive(),
            protect=[os.getpgrp(), os.getsid(0)],
            spare=self.spare,
        )


def _token_of(pid: int) -> str | None:
    entry = f"{TOKEN}=".encode()
    for value in _guard.environment(pid):
        if value.startswith(entry):
            return value[len(entry) :].decode("ascii", "replace")
    return None


def _running(pid: int, start: int) -> bool:
    p = _guard.read_proc(pid)
    return p is not None and p.start == start and not p.zombie


def _ancestors(procs: dict[int, _guard.Proc]) -> set[int]:
    found, pid = set(), os.getpid()
    while pid > 1 and pid not in found:
        found.add(pid)
        pid = procs[pid].ppid if pid in procs else 1
    return found
