"""The run's lock: ``supervisor.lock``, held (``flock``) by the run's one supervisor."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from pathlib import Path

from .._errors import PreemptibleError, RunLockedError
from .._files import open_in_place
from .._paths import LOCK_NAME
from ._guard import read_proc

logger = logging.getLogger("preemptible")

LOCK_WAIT = 15.0  # seconds a guardian may take to stop the attempt of a supervisor killed


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


def lock_run(run_dir: Path, run_id: str) -> int:
    """Hold the run's lock (an advisory ``flock``, released when the fd closes, also when the
    supervisor is killed); not inherited by the job (``O_CLOEXEC``)."""
    path = run_dir / LOCK_NAME
    try:
        fd = open_in_place(path, os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        fix = (
            "remove it (the supervisor creates the lock as a regular file) and start again"
            if os.path.lexists(path) and exc.errno != errno.EROFS
            else "use a --home this user can write to"
        )
        raise PreemptibleError(f"cannot open {path}: {exc.strerror or exc}; {fix}") from exc
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
    except OSError as exc:  # a file system without locks: fail closed, never run unlocked
        os.close(fd)
        raise PreemptibleError(
            f"cannot lock {path}: {exc.strerror or exc}; use a --home on a file system with "
            "locks (a local disk, NFS with its lock service)"
        ) from exc
    with contextlib.suppress(OSError):  # the pid is only for the message above
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _decimal(text: str) -> bool:
    """ASCII digits only: ``str.isdigit()`` also takes "²", which ``int()`` refuses."""
    return text.isascii() and text.isdigit()
