"""One attempt's processes: a child in its own process group, reaped to the last member, and
whatever it leaves behind stopped.

The supervisor becomes a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): every orphan the
job leaves is re-parented to the supervisor instead of init. That does two things:

- a wrapper shell that dies from a forwarded signal while its training child is still writing
  a checkpoint leaves that child in the group, ``waitid(P_PGID)`` sees it, and the attempt is
  classified only after every process of the group has exited;
- a process that left the group (a daemon that double-forked and called ``setsid()``) becomes
  a child of the supervisor, so it can be found (``/proc/*/stat``, parent = us) and stopped
  when the attempt ends, and is told to the guardian so that it dies with the supervisor too.

Children that existed before the attempt started (an earlier attempt's guardian, anything the
host program started) are never touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ._classify import Ending

logger = logging.getLogger("preemptible")

_PR_SET_CHILD_SUBREAPER = 36


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
    found: dict[int, tuple[int, bool]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:  # pragma: no cover - not Linux
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            if int(fields[1]) == me:
                found[int(name)] = (int(fields[2]), fields[0] == b"Z")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found


class ProcessGroup:
    """``argv`` started in a new session (and so a new process group led by it)."""

    def __init__(
        self, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path | None = None
    ) -> None:
        self.argv = list(argv)
        known = set(children())  # not ours to stop when the attempt ends
        self.proc = subprocess.Popen(self.argv, env=dict(env), cwd=cwd, start_new_session=True)
        self.pid = self.pgid = self.proc.pid
        self.started = time.monotonic()
        self.ending: Ending | None = None
        self.escaped: set[int] = set()  # process groups the job started outside its own
        try:
            self._guardian = self._start_guardian()
        except BaseException:  # never a job without its guardian
            self.signal(signal.SIGKILL)
            self.proc.wait()
            raise
        self._not_ours = known | {self._guardian.pid}

    def _start_guardian(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "preemptible.supervisor._guard", str(self.pgid)],
            stdin=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
        )

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to every process of the group; False when nobody is left."""
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            return False
        return True

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
    def _leftovers(self) -> dict[int, int]:
        """Our children that belong to this attempt but not to its group: pid -> pgid.
        Zombies among them are reaped on the way."""
        found = {}
        for pid, (pgid, zombie) in children().items():
            if pid in self._not_ours or pid == self.pid or pgid == self.pgid:
                continue
            if zombie:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                continue
            found[pid] = pgid
        return found

    def watch(self) -> set[int]:
        """Tell the guardian about process groups the job started outside its own (so that
        they die with the supervisor too); returns the new ones."""
        new = {pgid for pgid in self._leftovers().values() if pgid not in self.escaped}
        new.discard(os.getpgrp())
        stdin = self._guardian.stdin
        for pgid in sorted(new):
            self.escaped.add(pgid)
            if stdin is not None:
                with contextlib.suppress(OSError):
                    stdin.write(f"+{pgid}\n".encode())
                    stdin.flush()
        return new

    def stop_leftovers(self, grace: float, sleep: Callable[[float], None]) -> list[int]:
        """SIGTERM the process groups of what the attempt left outside its group, SIGKILL
        what is still there ``grace`` seconds later; reap them. Returns their pids."""
        deadline = time.monotonic() + grace
        sig = signal.SIGTERM
        signalled: set[int] = set()
        seen: list[int] = []
        while True:
            left = self._leftovers()
            if not left:
                return seen
            now = time.monotonic()
            if now >= deadline:
                if sig == signal.SIGKILL:
                    logger.error(
                        "preemptible: processes %s the job left behind survive SIGKILL; "
                        "giving up on them",
                        sorted(left),
                    )
                    return seen
                sig, deadline = signal.SIGKILL, now + 2.0
                signalled.clear()
            for pid, pgid in left.items():
                if pid in signalled:
                    continue
                signalled.add(pid)
                if pid not in seen:
                    seen.append(pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if pgid == os.getpgrp():  # never our own group
                        os.kill(pid, sig)
                    else:
                        os.killpg(pgid, sig)
            sleep(min(0.1, max(deadline - now, 0.0)))

    def close(self, *, done: bool = True) -> None:
        """Dismiss the guardian. ``done=False`` (the supervisor is failing with the job still
        running) closes the pipe without the word, and the guardian kills what it knows."""
        stdin = self._guardian.stdin
        if stdin is not None:
            with contextlib.suppress(OSError):
                if done:
                    stdin.write(b"done\n")
                stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._guardian.wait(timeout=5)

    @property
    def duration(self) -> float:
        return time.monotonic() - self.started
