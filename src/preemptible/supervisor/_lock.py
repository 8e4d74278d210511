"""The run's lock: ``supervisor.lock``, held (``flock``) by the run's one supervisor.

The file names its holder: its pid on the first line (for messages), and on the second
``boot_id/pid_namespace/pid/start_ticks``. A supervisor that finds the lock held waits for the
guardian of a holder that is *provably* gone (same boot, same pid namespace, no such process
any more): it is stopping that attempt's processes. A holder it cannot see (another pid
namespace: another container or host on a shared ``--home``; another boot; a file of an older
version that names no namespace) is not gone for all it knows: the run is locked, at once, and
the caller waits (a sweep's run stays in the queue; the lease decides, and the holder's own
guardian stops its attempt by the lease, ``_guard.Fence``)."""

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
from ..notices._lease import boot_id
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
            holder = _holder(fd)
            if not _gone(holder) or time.monotonic() >= deadline:
                raise
            if not told:
                told = True
                logger.info(
                    "preemptible: run %s: its last supervisor (pid %s) is gone; waiting for its "
                    "guardian to stop that attempt's processes",
                    run_id,
                    holder.split("\n", 1)[0],
                )
            time.sleep(0.05)


def _holder(fd: int) -> str:
    return os.pread(fd, 256, 0).decode("ascii", "replace").strip()


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return ""


def identity() -> str:
    """What the lock file says of this process: ``pid`` and ``boot/namespace/pid/start``."""
    me = read_proc(os.getpid())
    start = me.start if me is not None else ""
    return f"{os.getpid()}\n{boot_id()}/{_pid_namespace()}/{os.getpid()}/{start}\n"


def _gone(holder: str) -> bool:
    """Whether the holder the lock file names is provably gone: on this boot and in this pid
    namespace, and no process of its pid and start time runs (a zombie does not). Anything
    that cannot be told from here is not gone (module docstring)."""
    lines = holder.splitlines()
    if len(lines) != 2 or not _decimal(lines[0]):
        return False
    parts = lines[1].split("/")
    if len(parts) != 4 or parts[2] != lines[0] or not _decimal(parts[3]):
        return False
    boot, namespace, pid, start = parts
    if not boot or boot != boot_id() or not namespace or namespace != _pid_namespace():
        return False
    proc = read_proc(int(pid))
    return proc is None or proc.zombie or proc.start != int(start)


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
        pid = _holder(fd).split("\n", 1)[0].strip()
        os.close(fd)
        who = f"pid {pid}" if _decimal(pid) else "another process"
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
        os.pwrite(fd, identity().encode(), 0)
    return fd


def _decimal(text: str) -> bool:
    """ASCII digits only: ``str.isdigit()`` also takes "²", which ``int()`` refuses."""
    return text.isascii() and text.isdigit()
