"""Files written so that a crash never leaves half of one: fsync helpers, whole-file
replacement, in-place writes that refuse links, and who wrote a temporary (host and pid).

Every module that commits something to disk (checkpoints, the run record, the journal, the
reported metrics) uses these, so the protocol is written once.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from typing import NamedTuple

from ._paths import file_kind

_PID_LIMIT = 4_194_304  # Linux's PID_MAX_LIMIT: no process on this host has a pid this high
_HOST_CHARS = re.compile(r"[^A-Za-z0-9-]")
_HOST_MAX = 63


def host_tag() -> str:
    """This host's name as it appears in temporary names: [A-Za-z0-9-] only, at most 63."""
    return _HOST_CHARS.sub("-", socket.gethostname())[:_HOST_MAX] or "unknown"


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory tree and every file in it."""
    if path.is_dir():
        for root, _dirs, files in os.walk(path):
            for name in files:
                _fsync_fd_of(Path(root) / name, os.O_RDONLY)
            _fsync_fd_of(Path(root), os.O_RDONLY | os.O_DIRECTORY)
    else:
        _fsync_fd_of(path, os.O_RDONLY)


def fsync_dir(path: Path) -> None:
    _fsync_fd_of(path, os.O_RDONLY | os.O_DIRECTORY)


def write_text_atomic(path: Path, text: str, *, durable: bool = False) -> None:
    """Replace ``path`` whole with ``text``. The temporary has an unpredictable name
    (``mkstemp``) in the same directory, so nobody can plant a symlink where it is written, and
    ``os.replace`` swaps the name itself, never writing through a link. ``durable``: fsync the
    file before the rename and the directory after it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fh.fileno(), 0o644)
            fh.write(text)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def open_in_place(path: Path, flags: int) -> int:
    """``os.open`` (mode 0644 when created) for a file written in place (a lock, a journal):
    never through a symbolic link, and never into a file that has other names (a hard link
    to a checkpoint), either of which would make a write land outside its directory."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            link = "a symbolic link; it is not written through"
            raise OSError(exc.errno, link, str(path)) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(st.st_mode) else "a file with other names"
        raise OSError(errno.EPERM, f"{what}; it is not written in", str(path))
    return fd


def _fsync_fd_of(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_path(path: Path) -> None:
    """Best effort: used on error paths, where the original error is the one to report."""
    try:
        is_dir = stat.S_ISDIR(path.lstat().st_mode)
    except OSError:  # gone, or its directory no longer searchable
        return
    if is_dir:
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def pid_alive(pid: int) -> bool:
    if not 0 < pid < _PID_LIMIT:  # os.kill(0, ...) is our own group; huge ones overflow
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FileLock(NamedTuple):
    """One lock held on this machine, as ``/proc/locks`` shows it."""

    kind: str  # FLOCK, POSIX, OFDLCK, ...
    mode: str  # READ or WRITE
    pid: int  # as this process's pid namespace sees it (-1 for an open file's own lock)
    file: tuple[int, int, int]  # (major, minor, inode)
    start: int
    end: int | None  # None: to the end of the file


def file_locks(table: Path = Path("/proc/locks")) -> list[FileLock]:
    """Every lock held on this machine (waiters, "->", left out), read from ``table``;
    empty where it cannot be read. A lock is looked up this way, never taken (taking it
    would turn away its holder starting up)."""
    try:
        with open(table, encoding="ascii", errors="replace") as fh:
            lines = fh.read(1 << 22).splitlines()
    except OSError:
        return []
    locks = []
    for line in lines:
        # "1: POSIX  ADVISORY  WRITE 3665 fe:00:2146374 120 120"
        fields = line.split()
        if len(fields) != 8 or "->" in fields:
            continue
        _, kind, _, mode, pid, where, start, end = fields
        parts = where.split(":")
        try:
            file = (int(parts[0], 16), int(parts[1], 16), int(parts[2]))
            locks.append(
                FileLock(kind, mode, int(pid), file, int(start), None if end == "EOF" else int(end))
            )
        except (ValueError, IndexError):
            continue
    return locks


def file_id(st: os.stat_result) -> tuple[int, int, int]:
    """A file's (major, minor, inode): how ``/proc/locks`` names it."""
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def held_flocks() -> set[tuple[int, int, int]]:
    """(major, minor, inode) of every file with an flock on this machine (``file_locks``)."""
    return {lock.file for lock in file_locks() if lock.kind == "FLOCK"}


def describe_unopenable(path: Path, exc: OSError) -> str:
    """What stands at ``path`` instead of a lock file we can open, for one line."""
    try:
        st = os.lstat(path)
    except OSError:
        return f"not a file we can open ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            return f"a symbolic link (to {os.readlink(path)})"
        return "a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return file_kind(st.st_mode)
    if st.st_nlink != 1:
        return f"a file with {st.st_nlink} names (a hard link)"
    return f"a file this process cannot open ({exc.strerror or exc})"
