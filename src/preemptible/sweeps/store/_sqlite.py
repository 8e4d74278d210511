"""The SQLite side of the sweep store: one file, WAL, one writer at a time.

Every write is a ``BEGIN IMMEDIATE`` transaction: it takes the database's write lock before
reading anything, so a claim reads and updates the queue with no other writer in between
(agents on one host never take the same run). WAL lets ``status`` read while agents write.
``synchronous=NORMAL`` keeps the file consistent when a process dies; a power loss may undo
the last commits, and with them the claims of agents that died in the same power loss.

A reader (``status``) of a file it cannot write (a read-only file system, another user's
file or directory) opens it read-only. WAL needs the ``-shm`` index: where it exists the file
is opened ``mode=ro`` (and sees the agents' latest commits); where it does not and cannot be
made, nobody has the database open, so it is either complete in the main file (opened
``immutable=1``) or, when a ``-wal`` file was left behind, read from a private copy of both.

The file is the queue: a process that opened it keeps to that file (device and inode). One
deleted or replaced under running agents (``rm``, a copy put in its place) is found at the next
transaction, and every agent stops (``DatabaseGone``) instead of writing to a deleted file
while others see a new one. A connection opened with ``create=False`` or as a reader (agents,
their heartbeat threads, ``status``, the sweep controls) never makes a new empty file:
SQLite's ``mode=rw``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ..._errors import DatabaseGone
from ..._files import file_id, file_locks
from ._backend import FULL, UNREACHABLE
from ._local import process_stat

logger = logging.getLogger("preemptible")

# How long SQLite itself waits for another writer before "database is locked"; past it the
# store's own retry (with backoff, up to its deadline) takes over.
BUSY_TIMEOUT = 10.0
_SQLITE_FULL = 13  # sqlite3.SQLITE_FULL: "database or disk is full"


class SqliteBackend:
    kind = "sqlite"

    def __init__(self, path: Path, *, reader: bool = False, create: bool = True) -> None:
        self.path = path
        self.display = f"sqlite://{path}"  # the path is absolute: sqlite:///abs
        self.reader = reader
        self.create = create and not reader
        self.identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the file, once opened

    def _identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def _gone(self) -> DatabaseGone:
        now = self._identity()
        what = "was deleted" if now is None else "was replaced by another file"
        return DatabaseGone(
            f"the sweep database {self.display} {what} while in use; nothing is recreated "
            "(put the file back, or create a new sweep with `preemptible sweep create`)"
        )

    def _missing(self) -> DatabaseGone:
        return DatabaseGone(
            f"no sweep database at {self.display} (deleted, or no sweep was created there: "
            "`preemptible sweep create SPEC.yaml` makes one; or pass --db)"
        )

    def check(self) -> None:
        """The file is still the one this process opened first."""
        if self.identity is not None and self._identity() != self.identity:
            raise self._gone()

    def connect(self) -> Any:
        import sqlite3

        if not self.create and self.identity is None and self._identity() is None:
            raise self._missing()
        self.check()
        if self.reader and self.path.is_file() and not self._writable():
            conn = self._connect_read_only()
        else:
            if self.create:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            open_mode = "rwc" if self.create and self.identity is None else "rw"
            uri = f"file:{quote(str(self.path))}?mode={open_mode}"
            try:
                conn = sqlite3.connect(
                    uri,
                    uri=True,
                    timeout=BUSY_TIMEOUT,
                    isolation_level=None,
                    check_same_thread=False,
                )
            except sqlite3.OperationalError:
                if open_mode == "rw" and self._identity() is None:  # gone since the look
                    raise (self._gone() if self.identity is not None else self._missing()) from None
                raise
            try:
                self._settings(conn)
            except BaseException:
                conn.close()
                raise
        try:
            found = self._identity()
            if self.identity is None:
                self.identity = found
            elif found != self.identity:
                raise self._gone()
        except BaseException:
            conn.close()
            raise
        return conn

    def _settings(self, conn: Any) -> None:
        # SQLite runs on one host, so its wall clock is the one clock every agent sees.
        conn.create_function("preemptible_now", 0, time.time)
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            logger.warning(
                "preemptible: %s stays in journal mode %s (no WAL on this file system?); "
                "readers will wait for writers",
                self.display,
                mode,
            )
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")

    def _writable(self) -> bool:
        """Whether this process may write the database: the file, and the directory where
        SQLite makes its -wal, -shm and journal files (EROFS counts as not writable)."""
        return os.access(self.path, os.W_OK) and os.access(self.path.parent, os.W_OK)

    def _connect_read_only(self) -> Any:
        import sqlite3

        shm, wal = Path(f"{self.path}-shm"), Path(f"{self.path}-wal")
        target, mode = self.path, "mode=ro"
        if not shm.exists():
            if wal.exists() and wal.stat().st_size > 0:
                target, mode = self._private_copy(wal), "mode=rw"
            else:
                mode = "immutable=1"
        logger.debug("preemptible: %s is not writable here; reading it (%s)", self.display, mode)
        conn = sqlite3.connect(
            f"file:{quote(str(target))}?{mode}",
            uri=True,
            timeout=BUSY_TIMEOUT,
            isolation_level=None,
            check_same_thread=False,
        )
        conn.create_function("preemptible_now", 0, time.time)
        return conn

    def _private_copy(self, wal: Path) -> Path:
        """The database and the -wal file left behind by its last writer, copied where this
        process may write, so that SQLite can read the commits in the WAL; removed at exit."""
        folder = tempfile.mkdtemp(prefix="preemptible-readonly-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        copy = Path(folder) / self.path.name
        shutil.copyfile(self.path, copy)
        shutil.copyfile(wal, f"{copy}-wal")
        return copy

    @contextlib.contextmanager
    def transaction(self, conn: Any, *, write: bool) -> Iterator[Any]:
        self.check()
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield conn.cursor()
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                with contextlib.suppress(Exception):
                    conn.execute("ROLLBACK")
            raise

    def transient(self, exc: BaseException) -> str | None:
        """Another writer holds the file (locked, busy), or its disk is full (SQLITE_FULL:
        a commit that needs a page the file system cannot give; SQLite rolls it back whole, so
        the same transaction runs again once there is space)."""
        import sqlite3

        if not isinstance(exc, sqlite3.OperationalError):
            return None
        text = str(exc).lower()
        if getattr(exc, "sqlite_errorcode", None) == _SQLITE_FULL or "is full" in text:
            return FULL
        return UNREACHABLE if "locked" in text or "busy" in text else None

    def blocker(self) -> str | None:
        """Who keeps the file's write lock, where that is a stopped process of this host
        (SIGSTOP cannot be caught: stopped inside a transaction, it keeps the lock until it
        is continued); None otherwise."""
        for pid in write_lock_holders(Path(f"{self.path}-shm")):
            found = process_stat(pid)
            if found is not None and found[0] in ("T", "t"):  # stopped, or by a debugger
                return (
                    f"its write lock is held by process {pid}, which is stopped: "
                    f"`kill -CONT {pid}` continues it"
                )
        return None

    def broken(self, conn: Any) -> bool:
        return False

    def convert(self, sql: str) -> str:
        return sql

    def scrub(self, text: str) -> str:
        return text


# SQLite's WAL write lock: a POSIX lock on this byte of the -shm file (its first lock byte)
_WAL_WRITE_LOCK_BYTE = 120


def write_lock_holders(shm: Path, table: Path = Path("/proc/locks")) -> list[int]:
    """The pids (as this process sees them) holding the WAL write lock of the database whose
    ``-shm`` file is ``shm``, read from the lock table; empty where that cannot be read."""
    try:
        file = file_id(os.stat(shm))
    except OSError:
        return []
    return [
        lock.pid
        for lock in file_locks(table)
        if lock.file == file
        and lock.mode == "WRITE"
        and lock.pid > 0
        and lock.start <= _WAL_WRITE_LOCK_BYTE
        and (lock.end is None or lock.end >= _WAL_WRITE_LOCK_BYTE)
    ]
