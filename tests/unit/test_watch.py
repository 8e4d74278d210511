"""SQLite's expiry without a shared wall clock (``sweeps/_watch.py``), and schema version 5 on
a database that a running agent of version 4 holds."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from preemptible.sweeps.store import _schema, _sqlite, _watch
from preemptible.sweeps.store._queue import Store, open_store
from preemptible.sweeps.store._watch import BeatWatch


class Clock:
    """Stands in for the ``time`` module: both the wall clock and the monotonic one."""

    def __init__(self) -> None:
        self.wall = 1000.0
        self.mono = 50.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(_sqlite, "time", fake)
    monkeypatch.setattr(_watch, "time", fake)
    return fake


def new_sweep(store: Store) -> str:
    spec = {"method": "grid", "parameters": {"x": {"values": [1]}}}
    sweep = store.create_sweep(spec, name=None, run_cap=None, max_failures=0, max_preemptions=1)
    store.add_runs(sweep, [{"x": 1}])
    return sweep


def test_a_lease_is_unchanged_only_while_its_epoch_and_counter_are(clock: Clock) -> None:
    watch = BeatWatch()
    assert watch.unchanged_for("r", 1, 0) == 0.0
    clock.mono += 5
    assert watch.unchanged_for("r", 1, 0) == 5.0
    assert watch.unchanged_for("r", 1, 1) == 0.0  # renewed
    clock.mono += 2
    assert watch.unchanged_for("r", 2, 1) == 0.0  # claimed again
    watch.keep([])
    clock.mono += 2
    assert watch.unchanged_for("r", 2, 1) == 0.0  # forgotten: watched afresh


def test_a_wall_clock_ahead_expires_nothing_and_renewals_keep_a_lease(
    tmp_path: Path, clock: Clock
) -> None:
    db = f"sqlite:///{tmp_path / 'q.db'}"
    with open_store(db) as holder, open_store(db) as taker:
        sweep = new_sweep(holder)
        c = holder.claim(sweep, agent="a", host="h", lease=10, propose=None)
        assert c is not None
        clock.wall += 600  # the taker's "now" is far past the lease: it is not asked
        assert taker.expire_leases() == []
        for _ in range(5):  # a renewal every 5 s for 25 s
            clock.mono += 5
            holder.heartbeat(c.run_id, agent="a", lease=10, attempt=1, epoch=c.epoch)
            assert taker.expire_leases() == []
        clock.mono += 11.9  # the lease (10 s) and its margin (2 s) not yet over
        assert taker.expire_leases() == []
        clock.mono += 0.2
        assert taker.expire_leases() == [c.run_id]


def test_version_5_keeps_a_running_run_of_a_version_4_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = f"sqlite:///{tmp_path / 'q.db'}"
    everything = _schema.migrations
    monkeypatch.setattr(_schema, "migrations", lambda kind: everything(kind)[:4])
    with open_store(db) as old:
        assert old.schema_versions() == [1, 2, 3, 4]
        sweep = new_sweep(old)
    path = db[len("sqlite:///") :]
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:  # claimed by version 4
        conn.execute(
            "UPDATE preemptible_runs SET state = 'RUNNING', attempt = 1, lease_epoch = 1, "
            "lease_owner = 'a', lease_host = 'h', lease_expires = 1e12, lease_seconds = 60"
        )
        conn.execute(
            "INSERT INTO preemptible_attempts (run_id, number, agent, host, started_at, epoch) "
            "SELECT id, 1, 'a', 'h', 1, 1 FROM preemptible_runs"
        )
    monkeypatch.setattr(_schema, "migrations", everything)
    with open_store(db) as new:
        assert new.schema_versions() == [1, 2, 3, 4, 5]
        [run] = new.runs(sweep)
        assert run.state == "RUNNING"
        new.heartbeat(run.id, agent="a", lease=60, attempt=1, epoch=1)
        state = new.finish(
            run.id,
            agent="a",
            attempt=1,
            epoch=1,
            ending="FINISHED",
            exit_code=0,
            duration=1.0,
            checkpoint_step=None,
            summary=None,
        )
        assert state == "FINISHED"
        [attempt] = new.attempts(run.id)
        assert (attempt.ending, attempt.late) == ("FINISHED", False)
