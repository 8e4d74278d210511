"""The PostgreSQL side of the sweep store (psycopg 3), for agents on several machines.

Each operation is one transaction on an autocommit connection. A dropped connection (a server
restart, a network cut) is closed and opened again by the store's retry loop; errors the
server gives at once for a wrong password or a missing database are not retried. The URL's
password is kept here only to connect and to scrub it out of any message (``Scrubber``: the
URL becomes its redacted form, each whole secret in it ``***``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

from ._backend import FULL, UNREACHABLE
from ._redact import Scrubber

# A server that answers these will answer them again: waiting does not help.
_PERMANENT = (
    "password authentication failed",
    "no password supplied",
    "authentication failed",
    "does not exist",
    "no pg_hba.conf entry",
    "permission denied",
    "invalid connection option",
    "invalid uri",
    "invalid integer value",
)

OUT_OF_MEMORY = "out of memory"
NO_SLOTS = "out of connection slots"
_RESOURCES = (
    (("too many connections", "too many clients", "connection slots are reserved"), NO_SLOTS),
    (("no space left on device", "could not extend file"), FULL),
    (("out of memory",), OUT_OF_MEMORY),
)

# seconds a session may sit inside a transaction without a statement (the server's
# idle_in_transaction_session_timeout); a claim's sampler runs inside one, well under this
IDLE_IN_TRANSACTION = 60
_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


class PostgresBackend:
    kind = "postgres"

    def __init__(self, url: str, display: str) -> None:
        self._url = url
        self._scrub = Scrubber(url, display)
        self.display = display

    def connect(self) -> Any:
        import psycopg

        options: dict[str, Any] = {"autocommit": True}
        if "connect_timeout" not in self._url:
            options["connect_timeout"] = 10
        if "keepalives" not in self._url:
            # a server whose machine vanished sends no reset: notice it in about a minute
            options.update(keepalives=1, keepalives_idle=30, keepalives_interval=10)
            options.update(keepalives_count=3)
        conn = psycopg.connect(self._url, **options)
        if "idle_in_transaction_session_timeout" not in self._url:
            try:
                # an agent stopped inside a transaction (SIGSTOP, a frozen VM) would keep
                # the rows it locked until it is continued: the server ends its session
                # instead, by the time a default lease would have run out
                conn.execute(f"SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION}s'")
            except BaseException:
                conn.close()
                raise
        return conn

    @contextlib.contextmanager
    def transaction(self, conn: Any, *, write: bool) -> Iterator[Any]:
        with conn.transaction(), conn.cursor() as cur:
            if not write:
                # a reader's queries (status reads counts, then rows) see one snapshot; READ
                # ONLY also lets them run on a standby or as a role that may only read
                cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            yield cur

    def transient(self, exc: BaseException) -> str | None:
        import psycopg

        if isinstance(exc, psycopg.InterfaceError):  # "the connection is closed/lost"
            return UNREACHABLE
        if isinstance(exc, psycopg.errors.IdleInTransactionSessionTimeout):
            return UNREACHABLE  # the server ended a session stopped inside a transaction
        # class 53, insufficient resources: the server rolled the transaction back and will
        # take it once space, memory or a connection slot is free again
        if isinstance(exc, psycopg.errors.DiskFull):  # 53100
            return FULL
        if isinstance(exc, psycopg.errors.OutOfMemory):  # 53200
            return OUT_OF_MEMORY
        if isinstance(exc, psycopg.errors.TooManyConnections):  # 53300
            return NO_SLOTS
        if isinstance(exc, psycopg.OperationalError):
            text = str(exc).lower()
            if any(marker in text for marker in _PERMANENT):
                return None
            # refused while connecting, the same causes come as words only (no SQLSTATE)
            for markers, cause in _RESOURCES:
                if any(marker in text for marker in markers):
                    return cause
            return UNREACHABLE
        return None

    def blocker(self) -> str | None:
        return None  # a stopped client's session is ended by the server (connect)

    def broken(self, conn: Any) -> bool:
        return bool(conn.closed or conn.broken)

    def convert(self, sql: str) -> str:
        return _PARAM.sub(r"%(\1)s", sql.replace("%", "%%"))

    def scrub(self, text: str) -> str:
        return self._scrub(text)
