"""The PostgreSQL side of the sweep store (psycopg 3), for agents on several machines.

Each operation is one transaction on an autocommit connection. A dropped connection (a server
restart, a network cut) is closed and opened again by the store's retry loop; errors the
server gives at once for a wrong password or a missing database are not retried. The URL's
password is kept here only to connect and to scrub it out of any message: a message shown
has the URL itself replaced by its redacted form, then every secret ``url_secrets`` finds in
it (each as written, %-decoded, and in pieces) replaced by ``***``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

from ._store import url_secrets

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

_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


class PostgresBackend:
    kind = "postgres"

    def __init__(self, url: str, display: str) -> None:
        self._url = url
        self._secrets = url_secrets(url)
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
        return psycopg.connect(self._url, **options)

    @contextlib.contextmanager
    def transaction(self, conn: Any, *, write: bool) -> Iterator[Any]:
        with conn.transaction(), conn.cursor() as cur:
            yield cur

    def transient(self, exc: BaseException) -> bool:
        import psycopg

        if isinstance(exc, psycopg.InterfaceError):  # "the connection is closed/lost"
            return True
        if isinstance(exc, psycopg.OperationalError):
            text = str(exc).lower()
            return not any(marker in text for marker in _PERMANENT)
        return False

    def broken(self, conn: Any) -> bool:
        return bool(conn.closed or conn.broken)

    def convert(self, sql: str) -> str:
        return _PARAM.sub(r"%(\1)s", sql.replace("%", "%%"))

    def scrub(self, text: str) -> str:
        text = text.replace(self._url, self.display)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text
