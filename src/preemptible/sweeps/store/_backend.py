"""What the store's connector asks of a database backend (SQLite, PostgreSQL), and the words
a backend names a passing outage with. The backends import this, never the connector, which
picks and imports them."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

# what keeps a database from answering, as a backend's ``transient`` names it; each passes
UNREACHABLE = "unreachable or locked"
FULL = "out of space"


class Backend(Protocol):
    kind: str
    display: str

    def connect(self) -> Any: ...
    def transaction(self, conn: Any, *, write: bool) -> AbstractContextManager[Any]: ...
    def transient(self, exc: BaseException) -> str | None:
        """What keeps the database from answering (``UNREACHABLE``, ``FULL``, ...) when
        ``exc`` may pass by itself, so the transaction is tried again; None when it will not."""

    def broken(self, conn: Any) -> bool: ...
    def convert(self, sql: str) -> str: ...
    def scrub(self, text: str) -> str: ...
    def blocker(self) -> str | None: ...
