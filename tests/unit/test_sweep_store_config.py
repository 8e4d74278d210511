"""The sweep store's pure parts: database URLs and their redaction, the run-state table after
an attempt, the SQL files, and lazy driver imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from preemptible import ConfigError
from preemptible.sweeps.store._endings import settle
from preemptible.sweeps.store._queue import open_store
from preemptible.sweeps.store._redact import redact_url
from preemptible.sweeps.store._schema import _load_queries, migrations, split_statements


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://bob:hunter2@db:5432/sweeps", "postgresql://bob:***@db:5432/sweeps"),
        ("postgres://bob:p%40ss@db/sweeps?sslmode=require",
         "postgres://bob:***@db/sweeps?sslmode=require"),
        ("postgresql://bob@db/sweeps?password=hunter2&sslmode=require",
         "postgresql://bob@db/sweeps?password=***"),  # what follows may be the password's
        ("postgresql://bob:a:b@[::1]:5432/x", "postgresql://bob:***@[::1]:5432/x"),
        ("postgresql://db/sweeps", "postgresql://db/sweeps"),
        ("postgresql://bob:secret@[::1/x", "postgresql://***"),  # unparsable: hide it all
        ("sqlite:///tmp/a.db", "sqlite:///tmp/a.db"),
    ],
)  # fmt: skip
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_url_forms_and_the_default_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PREEMPTIBLE_DB", raising=False)
    with open_store() as store:
        assert store.display == f"sqlite://{tmp_path}/.preemptible/sweeps.db"
    with open_store(root=tmp_path / "r") as store:
        assert store.display == f"sqlite://{tmp_path}/r/.preemptible/sweeps.db"
    with open_store(f"sqlite://{tmp_path}/abs.db") as store:
        assert store.display == f"sqlite://{tmp_path}/abs.db"
    with open_store("sqlite:rel/b.db", root=tmp_path / "r") as store:
        assert store.display == f"sqlite://{tmp_path}/r/rel/b.db"
    monkeypatch.setenv("PREEMPTIBLE_DB", "sqlite:from-env.db")
    with open_store() as store:
        assert store.display == f"sqlite://{tmp_path}/from-env.db"
    for path in ("abs.db", "rel/b.db", "from-env.db", ".preemptible/sweeps.db"):
        assert (tmp_path / path).exists() or (tmp_path / "r" / path).exists()


@pytest.mark.parametrize(
    "url", ["sqlite:", "sqlite://", "sqlite://host/x.db", "sqlite:dir/", "mysql://h/db", "x.db"]
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(
        ConfigError, match=r"use sqlite:///ABS/PATH\.db, sqlite:REL/PATH\.db or post"
    ):
        open_store(url)


def test_a_bad_retry_timeout_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PREEMPTIBLE_DB_RETRY_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="PREEMPTIBLE_DB_RETRY_TIMEOUT='soon' is not valid"):
        open_store(f"sqlite://{tmp_path}/a.db")
    with pytest.raises(ConfigError, match="retry_timeout=-1 is not valid"):
        open_store(f"sqlite://{tmp_path}/a.db", retry_timeout=-1)


BUDGETS = {"max_preemptions": 1, "max_failures": 1}


@pytest.mark.parametrize(
    ("ending", "lost", "before", "control", "after"),
    [
        ("FINISHED", False, (0, 0), "running", ("FINISHED", 0, 0)),
        ("FINISHED", False, (0, 0), "cancelled", ("FINISHED", 0, 0)),
        ("PREEMPTED", False, (0, 0), "running", ("PENDING", 1, 0)),
        ("PREEMPTED", False, (1, 0), "running", ("PREEMPTED", 2, 0)),
        ("PREEMPTED", False, (0, 0), "stopped", ("PENDING", 1, 0)),
        ("PREEMPTED", False, (0, 0), "cancelled", ("CANCELLED", 0, 0)),
        ("FAILED", False, (0, 0), "running", ("PENDING", 0, 1)),
        ("FAILED", False, (0, 1), "running", ("FAILED", 0, 2)),
        ("CRASHED", False, (0, 0), "running", ("PENDING", 0, 1)),
        ("CRASHED", False, (0, 1), "paused", ("CRASHED", 0, 2)),
        ("KILLED", False, (0, 0), "running", ("KILLED", 0, 0)),
        ("CANCELLED", False, (0, 0), "running", ("CANCELLED", 0, 0)),
        # a lost lease is a preemption, whatever the attempt is recorded as
        ("CRASHED", True, (0, 0), "running", ("PENDING", 1, 0)),
        ("CRASHED", True, (1, 0), "running", ("CRASHED", 2, 0)),
        ("PREEMPTED", True, (1, 0), "running", ("PREEMPTED", 2, 0)),
        ("CRASHED", True, (0, 0), "cancelled", ("CANCELLED", 0, 0)),
    ],
)
def test_settle(
    ending: str, lost: bool, before: tuple[int, int], control: str, after: tuple[str, int, int]
) -> None:
    preemptions, failures = before
    got = settle(
        ending, lost=lost, preemptions=preemptions, failures=failures, control=control, **BUDGETS
    )
    assert got == after


def test_sql_files_define_the_same_queries_for_both_backends() -> None:
    sqlite, postgres = _load_queries("sqlite"), _load_queries("postgres")
    # PostgreSQL stores a slice of history points in one statement of arrays; SQLite's
    # executemany of add_point is faster there than any one statement (sweeps/_history.py)
    postgres_only = {"add_points"}
    assert set(sqlite) == set(postgres) - postgres_only
    assert postgres_only <= set(postgres)
    assert "pick_pending" in sqlite and "FOR UPDATE SKIP LOCKED" in postgres["pick_pending"]
    assert (
        [v for v, _ in migrations("sqlite")]
        == [v for v, _ in migrations("postgres")]
        == [1, 2, 3, 4, 5]
    )


def test_split_statements() -> None:
    script = (
        "-- a comment; not a statement\nCREATE TABLE a (x int);\n\nCREATE TABLE b (\n  y int\n) ;\n"
    )
    assert split_statements(script) == ["CREATE TABLE a (x int)", "CREATE TABLE b (\n  y int\n)"]


def test_importing_the_store_imports_no_database_driver() -> None:
    code = (
        "import sys, preemptible, preemptible.sweeps.store._queue\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sqlite3', 'psycopg')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
