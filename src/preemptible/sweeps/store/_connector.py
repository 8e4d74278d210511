"""The sweep database's connection layer: the choice of a backend (``_backend``: the protocol
its SQLite and PostgreSQL drivers meet, ``_sqlite`` and ``_postgres``) from a database URL,
and the ``Connector``: one connection, transactions of named queries (``_Tx``), retries with backoff
and the record of outages (``_Health``). It knows no table: the queue's operations are the
``Store``'s, the schema's ``_schema``'s."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ..._env import env_float
from ..._errors import ConfigError, StoreError
from ._backend import FULL, Backend
from ._pause import GATE
from ._redact import redact_url, userinfo_problem

logger = logging.getLogger("preemptible")

T = TypeVar("T")
DEFAULT_RETRY_TIMEOUT = 300.0
MAX_BACKOFF = 5.0
_VALID_URLS = "sqlite:///ABS/PATH.db, sqlite:REL/PATH.db or postgresql://USER:PASSWORD@HOST:PORT/DB"


class _Health:
    """Shared by the stores of one agent (``Store.reopen``): when the database last answered
    again after being unreachable (monotonic), for ``recovery_hold``."""

    def __init__(self) -> None:
        self.recovered_at: float | None = None


def retry_timeout_of(retry_timeout: float | None) -> float:
    """Seconds each operation keeps retrying: ``retry_timeout``, checked, or
    ``$PREEMPTIBLE_DB_RETRY_TIMEOUT`` (300) when it is None."""
    if retry_timeout is None:
        retry_timeout = env_float("PREEMPTIBLE_DB_RETRY_TIMEOUT", DEFAULT_RETRY_TIMEOUT)
        assert retry_timeout is not None
    elif not (math.isfinite(retry_timeout) and retry_timeout >= 0):
        raise ConfigError(f"retry_timeout={retry_timeout!r} is not valid; use seconds >= 0")
    return retry_timeout


def choose_backend(url: str | None, base: Path, *, reader: bool, create: bool) -> Backend:
    """The backend of database URL ``url`` (None: ``<base>/.preemptible/sweeps.db``);
    ``base`` resolves a relative SQLite path. A URL that is not valid is a ConfigError that
    never shows its password."""
    from ._sqlite import SqliteBackend

    if url is None:
        path = (base / ".preemptible" / "sweeps.db").absolute()
        return SqliteBackend(path, reader=reader, create=create)
    if url.startswith("sqlite:"):
        rest = url[len("sqlite:") :]
        if rest.startswith("//"):
            rest = rest[2:]
            if not rest.startswith("/"):
                rest = ""  # sqlite://host/... : SQLite has no host
        if not rest or rest.endswith("/"):
            raise ConfigError(f"database URL {redact_url(url)!r} names no file; use {_VALID_URLS}")
        path = Path("/" + rest.lstrip("/")) if rest.startswith("/") else base / rest
        return SqliteBackend(path.absolute(), reader=reader, create=create)
    if url.startswith(("postgresql://", "postgres://")):
        shown = redact_url(url)
        problem = userinfo_problem(url)
        if problem is not None:
            raise ConfigError(f"database URL {shown!r}: {problem}")
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"database URL {shown!r} needs psycopg 3; pip install 'preemptible[postgres]'"
            ) from None
        from ._postgres import PostgresBackend

        return PostgresBackend(url, shown)
    raise ConfigError(f"database URL {redact_url(url)!r} is not valid; use {_VALID_URLS}")


class _Tx:
    """One transaction: named queries with keyword parameters, rows as dicts."""

    def __init__(self, cursor: Any, queries: dict[str, str], retry: bool) -> None:
        self._cur = cursor
        self._queries = queries
        self.retry = retry  # an earlier try of this same operation may have committed

    def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> int:
        if params:
            self._cur.execute(sql, params)
        else:
            self._cur.execute(sql)
        return int(self._cur.rowcount)

    def run(self, query: str, /, **params: Any) -> int:
        return self.execute(self._queries[query], params)

    def run_many(self, query: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """``query`` once for each of ``rows`` (its parameters), in this transaction."""
        if rows:
            self._cur.executemany(self._queries[query], rows)

    def all(self, query: str, /, **params: Any) -> list[dict[str, Any]]:
        self.execute(self._queries[query], params)
        columns = [d[0] for d in self._cur.description]
        return [dict(zip(columns, row, strict=True)) for row in self._cur.fetchall()]

    def iter(self, query: str, /, **params: Any) -> Iterator[tuple[Any, ...]]:
        """The rows of ``query`` as tuples in its column order, a batch at a time (a sweep of
        100,000 runs is never one list of Python rows); read them all before the next query
        of this transaction."""
        self.execute(self._queries[query], params)
        while rows := self._cur.fetchmany(2000):
            yield from rows

    def one(self, query: str, /, **params: Any) -> dict[str, Any] | None:
        rows = self.all(query, **params)
        return rows[0] if rows else None


class Connector:
    """One connection to the sweep database through its backend, opened on first use:
    transactions of named queries (``transact``), retried with backoff while the database is
    locked, restarting, unreachable or out of space (a transaction that failed for want of
    space was rolled back whole: it runs again once there is some), up to ``retry_timeout``;
    a driver's error reported in one line scrubbed of the URL's secrets (``StoreError``). One
    thread at a time."""

    def __init__(
        self, backend: Backend, queries: dict[str, str], *, retry_timeout: float, health: _Health
    ) -> None:
        self.backend = backend
        self.queries = queries  # name: SQL in the backend's parameter style
        self.retry_timeout = retry_timeout
        self.health = health
        self.display = backend.display  # the URL with its password hidden
        self._conn: Any = None
        # monotonic time at which the last successful try of an operation began: before the
        # database's clock read its "now", so a lease it set cannot end sooner than this + lease
        self.last_try_at = time.monotonic()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception as exc:  # closing a dead connection may complain; nothing to do
                logger.debug("preemptible: closing %s: %s", self.display, exc)

    def transact(self, fn: Callable[[_Tx], T], *, write: bool = True) -> T:
        """Run ``fn`` in one transaction; on a transient error reconnect if needed and run it
        again (with backoff) until the retry deadline."""
        started = time.monotonic()
        delay = 0.05
        failures = 0
        while True:
            connecting = self._conn is None
            tried_at = time.monotonic()
            try:
                if self._conn is None:
                    self._conn = self.backend.connect()
                connecting = False
                with GATE.passage(), self.backend.transaction(self._conn, write=write) as tx:
                    result = fn(_Tx(tx, self.queries, retry=failures > 0))
                self.last_try_at = tried_at
                if failures:
                    self.health.recovered_at = time.monotonic()
                    logger.warning(
                        "preemptible: the sweep database %s answers again (after %.1f s)",
                        self.display,
                        time.monotonic() - started,
                    )
                return result
            except Exception as exc:
                if isinstance(exc, StoreError):  # ours, already one line (DatabaseGone)
                    raise
                cause = self.backend.transient(exc)
                if cause is None:
                    if not self._driver_error(exc, connecting):
                        raise
                    error = StoreError(
                        f"cannot use the sweep database {self.display}: {self._say(exc)}"
                    )
                    if connecting:  # a driver may quote the connection string: no chain
                        raise error from None
                    raise error from exc
                if self._conn is not None and self.backend.broken(self._conn):
                    self.close()
                waited = time.monotonic() - started
                last = waited + delay > self.retry_timeout
                blocker = self.backend.blocker() if last or not failures else None
                why = f" ({blocker})" if blocker else ""
                if last:
                    raise StoreError(
                        f"the sweep database {self.display} is {cause}: "
                        f"{self._say(exc)}{why}; gave up after {waited:.0f} s "
                        "(PREEMPTIBLE_DB_RETRY_TIMEOUT)"
                    ) from None
                failures += 1
                if failures == 1:
                    logger.warning(
                        "preemptible: the sweep database %s is %s (%s%s); retrying for up to "
                        "%.0f s%s",
                        self.display,
                        cause,
                        self._say(exc),
                        why,
                        self.retry_timeout,
                        "; free some space where it is stored" if cause == FULL else "",
                    )
                time.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, MAX_BACKOFF)

    def _say(self, exc: BaseException) -> str:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        return self.backend.scrub(lines[0] if lines else type(exc).__name__)

    @staticmethod
    def _driver_error(exc: BaseException, connecting: bool) -> bool:
        """An error of the database driver (or of creating the file's directory), to be
        reported in one line (scrubbed of the URL's secrets); not our own errors, a
        sampler's, or a bug's. Anything raised while connecting counts: a driver refusing a
        URL may raise a plain ValueError quoting it, and that must not reach a traceback."""
        if connecting:
            return True
        return type(exc).__module__.startswith(("sqlite3", "psycopg"))
