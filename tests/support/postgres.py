"""PostgreSQL for the sweep store tests: one server per session, a fresh database per test.

tests/services/with-services.sh starts the server and exports PREEMPTIBLE_TEST_PG_URL (and
PREEMPTIBLE_TEST_PG_DIR, for restarts); without it the session starts its own. The
PostgreSQL tests skip only where no PostgreSQL server binaries are installed (or where
PREEMPTIBLE_TEST_PG_SKIP gives a reason).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

PG_SCRIPT = Path(__file__).resolve().parent.parent / "services" / "postgres.sh"


class PgServer:
    def __init__(self, url: str, directory: Path | None) -> None:
        self.url = url  # to its "postgres" database
        self.directory = directory  # None: started by someone else; not ours to restart

    def database_url(self, name: str) -> str:
        return urlunsplit(urlsplit(self.url)._replace(path=f"/{name}"))

    def admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True, connect_timeout=30) as conn:
            conn.execute(sql)

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        """A new, empty database: yields its name, drops it (connections and all) after."""
        name = f"test_{uuid.uuid4().hex[:12]}"
        self.admin(f'CREATE DATABASE "{name}"')
        try:
            yield name
        finally:
            self.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: every connection is dropped, the server comes back."""
        self._ctl("restart")

    def stop(self) -> None:
        """``pg_ctl stop -m fast``: an outage until ``start()`` (same port and data)."""
        self._ctl("stop")

    def start(self) -> None:
        self._ctl("start")

    def _ctl(self, command: str) -> None:
        assert self.directory is not None
        subprocess.run(
            ["bash", str(PG_SCRIPT), command, str(self.directory)], check=True, timeout=120
        )


def pg_binaries() -> bool:
    """Whether a PostgreSQL server could be started here (``pg_ctl`` is installed)."""
    return bool(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl") or shutil.which("pg_ctl"))


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    url = os.environ.get("PREEMPTIBLE_TEST_PG_URL")
    if url:
        directory = os.environ.get("PREEMPTIBLE_TEST_PG_DIR")
        yield PgServer(url, Path(directory) if directory else None)
        return
    if os.environ.get("PREEMPTIBLE_TEST_PG_SKIP"):
        pytest.skip(os.environ["PREEMPTIBLE_TEST_PG_SKIP"])
    if not pg_binaries():
        pytest.skip("no PostgreSQL server binaries (pg_ctl): install postgresql to run these")
    with _started() as server:
        yield server


@contextlib.contextmanager
def _started() -> Iterator[PgServer]:
    """A server of our own, removed after: in memory where possible (CREATE DATABASE per test
    is 3x faster); right under a sticky world-writable directory, so that the server's own
    user can reach it."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp"
    directory = Path(tempfile.mkdtemp(prefix="preemptible-pg-", dir=base))
    up = subprocess.run(
        ["bash", str(PG_SCRIPT), "up", str(directory)], capture_output=True, text=True, timeout=120
    )
    try:
        if up.returncode != 0:
            pytest.fail(f"could not start PostgreSQL: {up.stderr.strip()}", pytrace=False)
        yield PgServer(up.stdout.strip(), directory)
    finally:
        subprocess.run(["bash", str(PG_SCRIPT), "down", str(directory)], timeout=120)


@pytest.fixture
def own_pg_server(pg_server: PgServer) -> Iterator[PgServer]:
    """A PostgreSQL server for this test alone, for the tests that stop or restart theirs: the
    session's server stays up for the tests running beside them in the other lane
    (tests/conftest.py). Skips where ``pg_server`` would."""
    with _started() as server:
        yield server


@pytest.fixture
def pg_database(pg_server: PgServer) -> Iterator[str]:
    """The name of a new, empty database on ``pg_server``, dropped after the test."""
    with pg_server.database() as name:
        yield name


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of an empty sweep database: an SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite://{tmp_path}/sweeps.db"
        return
    server: PgServer = request.getfixturevalue("pg_server")
    with server.database() as name:
        yield server.database_url(name)
