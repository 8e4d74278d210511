"""The guardian, and the process-tree primitives it shares with the supervisor.

Who watches whom (see also ``_process.py``):

- the guardian watches the supervisor: it holds a pipe from it, and reading EOF without
  ``done`` first (the kernel closes the pipe when the supervisor dies, SIGKILL included) means
  the supervisor is gone: the guardian then kills every process of the attempt;
- the supervisor watches the guardian: the guardian is its child, and a dead one (a SIGKILL, the
  OOM killer) is replaced at once (``ProcessGroup.keep_guardian``);
- when both die at once, a new supervisor of the same run stops what is left before its first
  attempt starts (``EarlierAttempts`` in ``_process.py``).

Which processes are the attempt's: in a cgroup v2 (``cgroup`` in the config) every one, the
kernel keeps the list, and ``cgroup.kill`` ends them all. Without one the guardian tracks them
itself (``Tracker``): every ``POLL_INTERVAL`` it looks for new pids in ``/proc`` and adopts those
whose parent is a known member, or the supervisor (a child subreaper: orphans of the job are
re-parented to it while it lives). A process is known by its pid *and* its start time, so that a
pid the kernel has handed to an unrelated process since is never signalled. torchrun starts
each worker in a session of its own (``start_new_session=True``), which a process-group kill
never reaches; the tracker sees the workers as torchrun's children within one poll.

Killing without a cgroup: members are first stopped (SIGSTOP) so that they can neither fork
nor die and have their children re-parented away, then everything found (members, their
children, their process groups, processes whose environment names this attempt's
``PREEMPTIBLE_ATTEMPT_TOKEN``) is SIGKILLed. Signals go through a pidfd after the start time was
checked, so even that check cannot race with pid reuse.

The guardian also fences an agent's attempt by its lease (``Fence``), when it is given the
attempt's ``lease.json`` (``notices/_lease.py``): a sweep agent renews its lease from a thread
of its own process, and its supervisor runs in that process too, so a SIGSTOP of the agent (a
frozen VM, a paused container's agent, Ctrl+Z: ``sweeps/store/_pause.py`` stops the agent alone)
stops both, while its job, in a session of its own, trains on. A program with a handler
watches the lease file itself and stops in time; a plain script does not, and an agent on
another host (which cannot see these pids) would take the run over after the lease and run it
a second time at once. The guardian is the one process of the attempt that is neither the job
nor the agent: a session of its own (no terminal's Ctrl+Z or group signal reaches it), no
thread of the agent's, the standard library only, and it already knows every process of the
attempt. It reads the deadline the agent wrote at its last renewal (CLOCK_MONOTONIC, which
every process of one boot shares, and the guardian is always on the agent's host) and, unless
a renewal moves it on: SIGTERM to the job's group at the lease's self-stop point (``warn_s``
before the deadline, when the handler's own notice comes too; a poll of that notice later,
and none when the run record says the program is already stopping, so that a program that
watches the lease stops by its own notice, as before), SIGKILL to every process of the attempt
at the deadline or a term timeout after the SIGTERM, whichever comes first. The
deadline is ``LEASE_MARGIN`` of the lease before another agent may take the run over
(``sweeps/store/_endings.py``), so the attempt is gone before that, whether or not anyone runs on
the agent's side. It writes ``fence.json`` beside the lease file when it acts, so that the
agent, continued, knows its attempt was stopped for its lease, and a replaced guardian does
not send a second SIGTERM (a handler's second signal is a hard exit). A normal renewal
rewrites the file with a later deadline before the earlier one comes: it never fires. The
agent's watchdog thread (``sweeps/agent/_holding.py``) leaves the signals to the guardian while one
fences, and sends them itself otherwise.

This module imports the standard library only: the supervisor runs it as a plain script
(``python -I -S _guard.py CONFIG``), which is tracking within ~20 ms of its start where
``import preemptible`` would take ~300 ms.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

POLL_INTERVAL = 0.05  # seconds between two looks at /proc while the supervisor lives
MAX_POLL_SHARE = 0.05  # at most this share of one core: the interval grows on a busy machine
KILL_DEADLINE = 10.0  # seconds to wait for killed processes to be gone before giving up
ENV_LIMIT = 1 << 20  # bytes of a process's environment read to find the attempt's marker


class Proc(NamedTuple):
    pid: int
    ppid: int
    pgid: int
    sid: int
    start: int  # clock ticks after boot: with the pid, the identity of a process
    zombie: bool


def read_proc(pid: int) -> Proc | None:
    """``/proc/PID/stat``, or None when the process is gone (or was never there)."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.read(fd, 1024)
        finally:
            os.close(fd)
        # the command name may hold spaces and parentheses: the fields start after the last ")"
        fields = data[data.rindex(b")") + 2 :].split(b" ", 20)
        return Proc(
            pid,
            int(fields[1]),
            int(fields[2]),
            int(fields[3]),
            int(fields[19]),
            fields[0] in (b"Z", b"X"),
        )
    except (OSError, ValueError, IndexError):
        return None


def pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:  # pragma: no cover - no /proc
        return []


def processes() -> dict[int, Proc]:
    found = {}
    for pid in pids():
        proc = read_proc(pid)
        if proc is not None:
            found[pid] = proc
    return found


def owner(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def environment(pid: int) -> list[bytes]:
    """The environment the process was started with; [] when it cannot be read (another
    user's process, gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read(ENV_LIMIT).split(b"\0")
    except OSError:
        return []


def marked(
    procs: Iterable[Proc], entries: Iterable[bytes], *, spare: set[int], prefix: bool = False
) -> dict[int, int]:
    """Processes of this user whose environment has one of ``entries`` (the attempt's
    ``PREEMPTIBLE_ATTEMPT_TOKEN=...``, inherited by everything the job starts unless it clears
    its environment), or with ``prefix`` an entry that starts with one: pid -> start time."""
    wanted = set(entries)
    if not wanted:
        return {}
    uid = os.geteuid()
    found = {}
    for proc in procs:
        if proc.zombie or proc.pid in spare or proc.pid == 1:
            continue
        if uid != 0 and owner(proc.pid) != uid:
            continue
        values = environment(proc.pid)
        if prefix:
            hit = any(v.startswith(w) for v in values for w in wanted)
        else:
            hit = not wanted.isdisjoint(values)
        if hit:
            found[proc.pid] = proc.start
    return found


def signal_process(pid: int, start: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process that started at ``start``."""
    pidfd = -1
    with contextlib.suppress(OSError, AttributeError):
        pidfd = os.pidfd_open(pid)  # Linux >= 5.3: names this very process from here on
    try:
        proc = read_proc(pid)
        if proc is None or proc.start != start or proc.zombie:
            return False
        if pidfd >= 0:
            signal.pidfd_send_signal(pidfd, sig)
        else:  # pragma: no cover - old kernels: a tiny window between the check and the kill
            os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _newest_pid() -> int | None:
    """The pid the kernel handed out last (in this pid namespace), or None."""
    try:
        fd = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return int(os.read(fd, 128).split()[4])  # "0.50 0.40 0.30 2/130 8267"
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        return None


class Tracker:
    """The processes of one attempt, found by walking ``/proc``: the job and everything
    descended from it, and the orphans its supervisor adopted as a subreaper (children of the
    supervisor, started after the job, outside the supervisor's own session).

    ``poll()`` reads the stat file of new pids only, so a look costs a directory listing and a
    few reads, not one read per process of the machine."""

    def __init__(self, *, supervisor: int, job: int, spare: Iterable[int] = ()) -> None:
        self.supervisor = supervisor
        me = read_proc(supervisor)
        self.supervisor_sid = me.sid if me is not None else -1
        self.spare = {supervisor, os.getpid(), 1, *spare}  # never members
        self.members: dict[int, int] = {}  # pid -> start time
        self.ever: set[int] = set()  # every member's pid, exited ones too
        self.job = read_proc(job)
        self.since = self.job.start if self.job is not None else 0
        self._seen: set[str] = set()
        self._newest: int | None = None
        self._quiet = False  # the last look saw no new pid either

    def poll(self) -> list[int]:
        """Look for new members; returns their pids. When no process was made on the machine
        for two looks (the newest pid, /proc/loadavg's last field, stayed the same), that is
        the whole look: one small read. Two, because a pid is handed out a moment before its
        process shows in /proc: the look after a change lists /proc once more."""
        newest = _newest_pid()
        quiet = newest is not None and newest == self._newest
        if quiet and self._quiet:
            return []
        self._newest, self._quiet = newest, quiet
        try:
            names = set(os.listdir("/proc"))
        except OSError:  # pragma: no cover - no /proc
            return []
        new = names - self._seen
        self._seen = names
        for pid in [p for p in self.members if str(p) not in names]:
            del self.members[pid]  # gone: its pid may be anyone's next
        found = [p for p in map(read_proc, (int(n) for n in new if n.isdigit())) if p]
        found.sort(key=lambda p: p.start)  # parents before their children
        added: list[int] = []
        while True:
            more = [p for p in found if p.pid not in self.members and self._belongs(p)]
            if not more:
                return added
            for p in more:
                self.members[p.pid] = p.start
                self.ever.add(p.pid)
                added.append(p.pid)

    def _belongs(self, proc: Proc) -> bool:
        if proc.pid in self.spare:
            return False
        if self.job is not None and proc.pid == self.job.pid:
            return proc.start == self.job.start
        parent = self.members.get(proc.ppid)
        if parent is not None:
            return proc.start >= parent
        return (
            proc.ppid == self.supervisor
            and proc.start >= self.since
            and proc.sid != self.supervisor_sid  # the supervisor's own helpers (scontrol)
        )

    def alive(self, procs: dict[int, Proc]) -> dict[int, int]:
        """The members still running, checked against a fresh scan."""
        return {
            pid: start
            for pid, start in self.members.items()
            if (p := procs.get(pid)) is not None and p.start == start and not p.zombie
        }


def kill_tree(
    tracker: Tracker | None,
    *,
    markers: Iterable[bytes],
    protect: Iterable[int],
    spare: Iterable[int] = (),
    known: dict[int, int] | None = None,
    deadline: float = KILL_DEADLINE,
) -> list[int]:
    """SIGKILL every process of the attempt without a cgroup (see the module docstring);
    returns their pids. ``markers``: environment entries of the attempt; ``known``: processes
    of it found otherwise (pid -> start time); ``protect``: process groups never signalled as
    a whole (the supervisor's, the guardian's); ``spare``: processes never signalled."""
    markers = list(markers)
    groups_spared = {0, 1, os.getpgrp(), *protect}
    spare = {os.getpid(), 1, *spare} | (tracker.spare if tracker is not None else set())
    ever = tracker.ever if tracker is not None else set()
    stopped: dict[int, int] = {}
    while True:  # freeze until a look finds nothing new
        if tracker is not None:
            tracker.poll()
        procs = processes()
        found = tracker.alive(procs) if tracker is not None else {}
        found.update(marked(procs.values(), markers, spare=spare))
        for pid, start in (known or {}).items():
            if (p := procs.get(pid)) is not None and p.start == start and pid not in spare:
                found[pid] = start
        found.update(stopped)
        # Their children, and the rest of the process groups and sessions that one of them
        # made (led by one found, or by a member that has exited: a pid is not reused while
        # a group or session of that number exists). Never a group that someone else leads.
        leaders = set(found) | {pid for pid in ever if pid not in procs}
        groups = {p.pgid for pid in found if (p := procs.get(pid))} & leaders - groups_spared
        sessions = {p.sid for pid in found if (p := procs.get(pid))} & leaders - groups_spared
        grew = True
        while grew:
            grew = False
            for p in procs.values():
                if p.pid in found or p.pid in spare or p.zombie:
                    continue
                if p.ppid in found or p.pgid in groups or p.sid in sessions:
                    found[p.pid] = p.start
                    grew = True
        fresh = {pid: start for pid, start in found.items() if pid not in stopped}
        if not fresh:
            break
        for pid, start in fresh.items():
            signal_process(pid, start, signal.SIGSTOP)  # gone or not ours: not looked at again
            stopped[pid] = start
    for pid, start in stopped.items():
        signal_process(pid, start, signal.SIGKILL)
    wait_gone(stopped, deadline)
    return sorted(stopped)


def wait_gone(members: dict[int, int], timeout: float) -> bool:
    """Until none of ``members`` (pid -> start time) runs any more (a zombie does not)."""
    end = time.monotonic() + timeout
    while True:
        left = [
            pid
            for pid, start in members.items()
            if (p := read_proc(pid)) is not None and p.start == start and not p.zombie
        ]
        if not left:
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.02)


# -- cgroup v2 ----------------------------------------------------------------------------------
def cgroup_procs(path: Path) -> list[int]:
    """The processes in the cgroup and in the cgroups below it (a nested supervisor's)."""
    found = []
    with contextlib.suppress(OSError, ValueError):
        found += [int(x) for x in (path / "cgroup.procs").read_text().split()]
    with contextlib.suppress(OSError):
        for child in os.scandir(path):
            if child.is_dir(follow_symlinks=False):
                found += cgroup_procs(Path(child.path))
    return found


def cgroup_kill(path: Path, deadline: float = KILL_DEADLINE) -> list[int]:
    """SIGKILL every process in the cgroup and its descendants (``cgroup.kill``, Linux >=
    5.14), wait until it is empty and remove it; returns the pids that were in it."""
    victims = cgroup_procs(path)
    with contextlib.suppress(OSError):
        (path / "cgroup.kill").write_text("1")
    end = time.monotonic() + deadline
    while not cgroup_remove(path) and time.monotonic() < end:
        time.sleep(0.02)
    return victims


def cgroup_remove(path: Path) -> bool:
    """Remove the cgroup (children first, as a nested supervisor may have made some); False
    while a process is still in it."""
    try:
        children = [c for c in path.iterdir() if c.is_dir()]
    except FileNotFoundError:
        return True
    except OSError:
        return False
    for child in children:
        cgroup_remove(child)
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


# The stop signals (stop/_signals.py's STOP_SIGNALS; this script imports only the standard
# library, so it spells them out, and a unit test checks that the two agree).
IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


FENCE_NAME = "fence.json"  # beside the lease file: the guardian stopped the attempt for it
RECORD_NAME = "record.json"  # beside it too: the training process's run record (``_paths``)
STOPPING_STATES = ("stopping", "stopped")  # the record's states of a stop under way (_states)
LEASE_MAX_BYTES = 1 << 14
LEASE_POLL = 0.1  # seconds between two looks at the lease file, at most
NOTICE_SLACK = 1.5  # a program watching the lease polls it every second (its poll_interval)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if number == number and abs(number) != float("inf") else None


def _say(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"preemptible: {text}\n")
        sys.stderr.flush()


class Fence:
    """The attempt's lease, as its agent last wrote it, and what the guardian must do about
    it (module docstring). A file that cannot be read (being replaced, garbled) keeps the
    deadline last read: only a renewal moves it."""

    def __init__(self, lease: Path, term_timeout: float, run: str = "") -> None:
        self.lease = lease
        self.record = lease.with_name(FENCE_NAME)
        self.term_timeout = term_timeout
        self.run = run
        self.boot = _boot_id()
        self.deadline: float | None = None
        self.warn = 0.0
        self.termed_at: float | None = None
        self.killed = False
        self._seen: tuple[int, int, int] | None = None
        with contextlib.suppress(OSError, ValueError, TypeError):
            earlier = json.loads(self.record.read_text(encoding="utf-8"))  # a guardian before me
            if earlier.get("boot_id") == self.boot:
                self.termed_at = _finite(earlier.get("term_monotonic"))

    def read(self) -> None:
        try:
            st = os.stat(self.lease)
        except OSError:
            return
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._seen:
            return
        try:
            with open(self.lease, "rb") as fh:
                doc = json.loads(fh.read(LEASE_MAX_BYTES))
        except (OSError, ValueError, RecursionError):
            return
        if not isinstance(doc, dict) or doc.get("boot_id") != self.boot or not self.boot:
            return  # not a lease of this boot: its monotonic deadline means nothing here
        deadline, warn = _finite(doc.get("deadline_monotonic")), _finite(doc.get("warn_s"))
        if deadline is None or warn is None:
            return
        self._seen = key
        self.deadline, self.warn = deadline, max(warn, 0.0)

    def due(self, now: float) -> int | None:
        """The signal to send now, if any."""
        if self.deadline is None or self.killed:
            return None
        if now >= self.deadline or (
            self.termed_at is not None and now >= self.termed_at + self.term_timeout
        ):
            return signal.SIGKILL
        if self.termed_at is None and now >= self.term_point:
            return signal.SIGTERM
        return None

    @property
    def term_point(self) -> float:
        """When the SIGTERM is due: the lease's self-stop point, when the program's own notice
        comes (``notices/_lease.py``), and a poll of that notice later, so that a program that
        watches the lease stops by it as it always has: its own stop, which knows the
        deadline, comes first. A quarter of the warning at least is left before the SIGKILL
        at the deadline."""
        assert self.deadline is not None
        return self.deadline - self.warn + min(NOTICE_SLACK, 0.75 * self.warn)

    def stopping(self) -> bool:
        """Whether the program already stops (its handler wrote so in its run record)."""
        try:
            with open(self.lease.with_name(RECORD_NAME), "rb") as fh:
                doc = json.loads(fh.read(LEASE_MAX_BYTES))
        except (OSError, ValueError, RecursionError):
            return False
        return isinstance(doc, dict) and doc.get("state") in STOPPING_STATES

    def wait(self, now: float) -> float:
        """Seconds until the next look."""
        if self.deadline is None or self.killed:
            return LEASE_POLL
        points = [self.deadline, self.term_point]
        if self.termed_at is not None:
            points.append(self.termed_at + self.term_timeout)
        ahead = [p - now for p in points if p > now]
        return max(min([LEASE_POLL, *ahead]), 0.0)

    def termed(self, now: float, *, sent: bool) -> None:
        self.termed_at = now
        left = min((self.deadline or now) - now, self.term_timeout)
        how = (
            "the guardian stops it: SIGTERM"
            if sent
            else "its program is stopping by itself (it watches the lease); the guardian sends"
        )
        _say(
            f"run {self.run}: its agent has not renewed the lease for this attempt (the agent "
            f"is stopped, or cannot reach the database); {how}, SIGKILL in {left:.1f} s if it "
            "is not gone by then, before another agent may take the run over"
        )
        self._write(now)

    def kill(self, now: float) -> None:
        self.killed = True
        _say(
            f"run {self.run}: the lease for this attempt ran out unrenewed; the guardian "
            "kills what is left of it (SIGKILL), before another agent may take the run over"
        )
        self._write(now)

    def _write(self, now: float) -> None:
        doc = {
            "boot_id": self.boot,
            "term_monotonic": self.termed_at,
            "killed": self.killed,
            "at_monotonic": now,
            "deadline_monotonic": self.deadline,
        }
        with contextlib.suppress(OSError):
            fd = os.open(self.record, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, (json.dumps(doc) + "\n").encode())
            finally:
                os.close(fd)


# -- the guardian -------------------------------------------------------------------------------
def _kill_attempt(
    config: dict[str, object], tracker: Tracker | None, cgroup: Path | None, job: int
) -> None:
    marker = config.get("marker")
    protect = [int(p) for p in config.get("protect", [])]  # type: ignore[attr-defined]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if job > 1 and job not in protect:
            os.killpg(job, signal.SIGKILL)  # the job's own group, in case tracking lagged
    if cgroup is not None:
        cgroup_kill(cgroup)
    kill_tree(
        tracker,
        markers=[marker.encode("utf-8", "surrogateescape")] if isinstance(marker, str) else [],
        protect=protect,
    )


def main(argv: list[str]) -> int:
    """``_guard.py CONFIG``: CONFIG is JSON with ``supervisor`` and ``job`` (pids), ``spare``
    (pids never to touch), ``protect`` (process groups never to signal as a whole),
    ``marker`` (the attempt's environment entry), ``cgroup`` (a path, or null), and for an
    agent's attempt ``lease`` (its lease file, or null), ``term_timeout`` and ``run``."""
    config = json.loads(argv[1])
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)  # a group signal or a terminal's Ctrl+C is not for us
    cgroup = Path(config["cgroup"]) if config.get("cgroup") else None
    job = int(config["job"])
    tracker = None
    if cgroup is None:
        tracker = Tracker(
            supervisor=int(config["supervisor"]),
            job=job,
            spare=[int(p) for p in config.get("spare", [])],
        )
    fence = None
    if config.get("lease"):
        fence = Fence(
            Path(config["lease"]), float(config.get("term_timeout") or 0.0), str(config.get("run"))
        )
    interval = POLL_INTERVAL
    data = b""
    while True:
        timeout: float | None = None
        if tracker is not None:
            started = time.monotonic()
            tracker.poll()
            cost = time.monotonic() - started
            interval = max(POLL_INTERVAL, cost / MAX_POLL_SHARE)
            timeout = interval
        if fence is not None:
            now = time.monotonic()
            fence.read()
            due = fence.due(now)
            if due == signal.SIGTERM:
                send = not fence.stopping()  # a second signal would be a handler's hard exit
                fence.termed(now, sent=send)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    protect = [int(p) for p in config.get("protect", [])]
                    if send and job > 1 and job not in protect:
                        os.killpg(job, signal.SIGTERM)
            elif due == signal.SIGKILL:
                fence.kill(now)
                _kill_attempt(config, tracker, cgroup, job)
            wait = fence.wait(time.monotonic())
            timeout = wait if timeout is None else min(timeout, wait)
        if timeout is not None:
            ready, _, _ = select.select([0], [], [], timeout)
            if not ready:
                continue
        chunk = os.read(0, 4096)
        if not chunk:
            break
        data += chunk
    if b"done" in data.split(b"\n"):
        return 0
    # the supervisor is gone without a word: nothing of its attempt may outlive it
    _kill_attempt(config, tracker, cgroup, job)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
