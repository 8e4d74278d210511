"""One attempt's processes: a child in its own process group, reaped to the last member.

The supervisor becomes a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): when a wrapper
shell dies from a forwarded signal while its training child is still writing a checkpoint,
the orphan is re-parented to the supervisor instead of init, so ``waitid(P_PGID)`` sees it
and the attempt is classified only after every process of the group has exited.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
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


class ProcessGroup:
    """``argv`` started in a new session (and so a new process group led by it)."""

    def __init__(
        self, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path | None = None
    ) -> None:
        self.argv = list(argv)
        self.proc = subprocess.Popen(self.argv, env=dict(env), cwd=cwd, start_new_session=True)
        self.pid = self.pgid = self.proc.pid
        self.started = time.monotonic()
        self.ending: Ending | None = None
        self._guardian = self._start_guardian()

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

    def close(self) -> None:
        """Dismiss the guardian: the group is gone, nothing to kill."""
        stdin = self._guardian.stdin
        if stdin is not None:
            with contextlib.suppress(OSError):
                stdin.write(b"done")
                stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._guardian.wait(timeout=5)

    @property
    def duration(self) -> float:
        return time.monotonic() - self.started
