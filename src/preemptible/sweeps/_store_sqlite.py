"""The SQLite side of the sweep store: one file, WAL, one writer at a time.

Every write is a ``BEGIN IMMEDIATE`` transaction: it takes the database's write lock before
reading anything, so a claim reads and updates the queue with no other writer in between
(agents on one host never take the same run). WAL lets ``status`` read while agents write.
``synchronous=NORMAL`` keeps the file consistent when a process dies; a power loss may undo
the last commits, and with them the claims of agents that died in the same power loss.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("preemptible")

# How long SQLite itself waits for another writer before "database is locked"; past it the
# store's own retry (with backoff, up to its deadline) takes over.
BUSY_TIMEOUT = 10.0


class SqliteBackend:
    kind = "sqlite"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.display = f"sqlite://{path}"  # the path is absolute: sqlite:///abs

    def connect(self) -> Any:
        import sqlite3

        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(
            str(self.path), timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False
        )
        try:
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
        except BaseException:
            conn.close()
            raise
        return conn

    @contextlib.contextmanager
    def transaction(self, conn: Any, *, write: bool) -> Iterator[Any]:
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield conn.cursor()
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                with contextlib.suppress(Exception):
                    conn.execute("ROLLBACK")
            raise

    def transient(self, exc: BaseException) -> bool:
        import sqlite3

        text = str(exc).lower()
        return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)

    def broken(self, conn: Any) -> bool:
        return False

    def convert(self, sql: str) -> str:
        return sql

    def scrub(self, text: str) -> str:
        return text
