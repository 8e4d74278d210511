"""A process of the sweep stopped while it writes to the queue: Ctrl+Z (SIGTSTP) stops it
between two transactions, so the other agents keep writing; stopped where it cannot choose
(SIGSTOP, a frozen VM), PostgreSQL ends its session and frees its rows, and the process, once
continued, runs its transaction again. ``tests/scripts/hold_writes.py`` is nearly always
inside a write transaction, as no agent is: stopped at random it would be caught inside one
nearly every time. The writes checked here are the test's own, through sqlite3 and psycopg."""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from preemptible.sweeps.store._queue import open_store
from tests.conftest import SCRIPTS, Child, process_state, wait_for
from tests.support.postgres import PgServer

pytestmark = pytest.mark.timeout(120)

HOLD = str(SCRIPTS / "hold_writes.py")
STOPS = 12


def write_once(url: str, wait: float) -> int:
    """One write of row 1, waiting ``wait`` seconds at most for a lock; the row's new n."""
    if url.startswith("sqlite:"):
        conn = sqlite3.connect(url[len("sqlite://") :], timeout=wait, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("UPDATE hammer SET n = n + 1 WHERE id = 1")
            (n,) = conn.execute("SELECT n FROM hammer WHERE id = 1").fetchone()
            conn.execute("COMMIT")
            return int(n)
        finally:
            conn.close()
    import psycopg

    with psycopg.connect(url.split("?")[0], autocommit=True) as conn:
        conn.execute(f"SET lock_timeout = '{int(wait * 1000)}ms'")
        row = conn.execute("UPDATE hammer SET n = n + 1 WHERE id = 1 RETURNING n").fetchone()
        assert row is not None
        return int(row[0])


def start(spawn: Callable[..., Child], url: str) -> Child:
    child = spawn([sys.executable, HOLD, url])
    child.wait_line(lambda line: line.startswith("up"), timeout=60)
    return child


def read_n(url: str) -> int:
    if url.startswith("sqlite:"):  # a reader: the writer's busy threads would starve a writer
        conn = sqlite3.connect(url[len("sqlite://") :], timeout=30, isolation_level=None)
        try:
            (n,) = conn.execute("SELECT n FROM hammer WHERE id = 1").fetchone()
            return int(n)
        finally:
            conn.close()
    import psycopg

    with psycopg.connect(url.split("?")[0], autocommit=True) as conn:
        row = conn.execute("SELECT n FROM hammer WHERE id = 1").fetchone()
        assert row is not None
        return int(row[0])


def continued_and_writing(child: Child, url: str) -> None:
    before = read_n(url)
    os.kill(child.pid, signal.SIGCONT)
    wait_for(lambda: read_n(url) > before + 20, 30, "the process's writes after SIGCONT")


def test_ctrl_z_stops_an_agent_between_transactions(
    spawn: Callable[..., Child], store_url: str
) -> None:
    hold = start(spawn, store_url)
    for _ in range(STOPS):
        os.kill(hold.pid, signal.SIGTSTP)
        wait_for(lambda: process_state(hold.pid) == "T", 30, "the process stopped by its SIGTSTP")
        started = time.monotonic()
        write_once(store_url, 5)  # raises if the stopped process holds the lock
        assert time.monotonic() - started < 5
        continued_and_writing(hold, store_url)
    hold.signal(signal.SIGTERM)
    assert hold.wait(30) == 0, hold.output
    assert "committed" in hold.output and "Traceback" not in hold.output


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    with pg_server.database() as name:
        yield pg_server.database_url(name)


def test_postgresql_ends_the_session_of_a_process_stopped_inside_a_transaction(
    spawn: Callable[..., Child], pg_url: str
) -> None:
    """SIGSTOP: SQLite's lock stays the stopped process's own; PostgreSQL's server ends the
    session (the limit made short for the test; the store's own, 60 s, is checked below)."""
    store_url = pg_url
    hold = start(spawn, f"{store_url}?options=-c%20idle_in_transaction_session_timeout%3D1000")
    waits = []
    for _ in range(5):  # until one stop lands inside a transaction (nearly always the first)
        os.kill(hold.pid, signal.SIGSTOP)  # cannot be caught
        wait_for(lambda: process_state(hold.pid) == "T", 30, "the process stopped")
        started = time.monotonic()
        write_once(store_url, 30)  # once the server has ended the stopped sessions
        waits.append(time.monotonic() - started)
        continued_and_writing(hold, store_url)  # its transactions ran again on new sessions
        if waits[-1] > 0.5:
            break
    assert waits[-1] > 0.5, f"no stop landed inside a transaction: waits {waits}"
    hold.signal(signal.SIGTERM)
    assert hold.wait(30) == 0, hold.output
    assert "Traceback" not in hold.output
    with open_store(store_url) as store:
        shown = store._transact(
            lambda tx: (tx.execute("SHOW idle_in_transaction_session_timeout"), tx._cur.fetchone())
        )[1]
    assert shown == ("1min",)


@pytest.mark.waits
def test_a_writer_kept_out_of_sqlite_by_a_stopped_process_names_it(
    spawn: Callable[..., Child], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGSTOP inside an SQLite transaction: the lock stays the stopped process's (nothing can
    break it), and the store's one line says which process holds it and how to continue it."""
    from preemptible._errors import StoreError
    from preemptible.sweeps.store import _sqlite

    url = f"sqlite://{tmp_path}/sweeps.db"
    hold = start(spawn, url)
    os.kill(hold.pid, signal.SIGSTOP)
    wait_for(lambda: process_state(hold.pid) == "T", 30, "the process stopped")
    monkeypatch.setattr(_sqlite, "BUSY_TIMEOUT", 1.0)
    with pytest.raises(StoreError) as raised:
        for _ in range(20):  # until a stop lands inside a transaction (nearly always at once)
            with open_store(url, retry_timeout=0) as store:
                store._transact(lambda tx: tx.execute("UPDATE hammer SET n = n + 1 WHERE id = 1"))
            continued_and_writing(hold, url)
            os.kill(hold.pid, signal.SIGSTOP)
            wait_for(lambda: process_state(hold.pid) == "T", 30, "the process stopped")
    said = str(raised.value)
    assert f"held by process {hold.pid}, which is stopped: `kill -CONT {hold.pid}`" in said, said
    os.kill(hold.pid, signal.SIGCONT)
    hold.signal(signal.SIGTERM)
    assert hold.wait(30) == 0, hold.output
