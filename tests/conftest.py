"""Shared helpers: spawn real processes, read their output as it comes, wait on conditions."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
PY = sys.executable

# A suite started in the background of a shell without job control (`make test &`, nohup)
# inherits SIGINT (and SIGHUP) ignored, and exec keeps an ignored signal ignored: every child
# would then ignore the Ctrl+C the tests send (preemptible leaves an ignored signal ignored,
# as documented). Children start from the defaults instead.
for _sig in (signal.SIGINT, signal.SIGHUP):
    if signal.getsignal(_sig) is signal.SIG_IGN:
        signal.signal(_sig, signal.default_int_handler if _sig == signal.SIGINT else signal.SIG_DFL)


def wait_for(predicate: Callable[[], object], timeout: float, what: str = "condition") -> object:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


class Child:
    """A child process in its own process group, with its output collected line by line."""

    def __init__(
        self,
        args: list[str],
        *,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        **popen: object,
    ) -> None:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            args,
            cwd=cwd,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            **popen,  # type: ignore[call-overload]
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, predicate: Callable[[str], bool], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        for line in list(self.lines):
            if predicate(line):
                return line
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no matching line within {timeout} s; output:\n{self.output}")
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(
                    f"process ended before a matching line; output:\n{self.output}"
                )
            if predicate(line):
                return line

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"process still running after {timeout} s; output:\n{self.output}"
            ) from None
        self._reader.join(timeout=5)
        return rc

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


@pytest.fixture
def spawn() -> Iterator[Callable[..., Child]]:
    """Start children with ``spawn(args, ...)``; each is killed with its group at teardown."""
    children: list[Child] = []

    def start(args: list[str], **kwargs: object) -> Child:
        child = Child(args, **kwargs)  # type: ignore[arg-type]
        children.append(child)
        return child

    yield start
    for child in children:
        child.kill()


def group_members(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def supervise(spawn, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Child:
    return spawn(
        [PY, "-m", "preemptible", "run", "--restart-delay", "0.05", *args], cwd=tmp_path, env=env
    )


def attempts(tmp_path: Path) -> list[dict[str, object]]:
    files = list((tmp_path / ".preemptible" / "runs").glob("*/attempts.jsonl"))
    assert len(files) == 1, files
    return [json.loads(line) for line in files[0].read_text().splitlines()]


def read_pid(path: Path) -> int:
    return int(wait_for(lambda: path.exists() and path.read_text().strip(), 30, f"{path}"))


def python_args(script: str, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / script), *args]


# ---- sweep store: a PostgreSQL server per session, a fresh database per test ----------------
# tests/services/with-services.sh starts the server and exports PREEMPTIBLE_TEST_PG_URL (and
# PREEMPTIBLE_TEST_PG_DIR, for restarts); without it the session starts its own. The
# PostgreSQL tests skip only where no PostgreSQL server binaries are installed.
PG_SCRIPT = ROOT / "tests" / "services" / "postgres.sh"


class PgServer:
    def __init__(self, url: str, directory: Path | None) -> None:
        self.url = url  # to its "postgres" database
        self.directory = directory  # None: started by someone else; not ours to restart

    def database_url(self, name: str) -> str:
        from urllib.parse import urlsplit, urlunsplit

        return urlunsplit(urlsplit(self.url)._replace(path=f"/{name}"))

    def admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True, connect_timeout=30) as conn:
            conn.execute(sql)

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


def _pg_binaries() -> bool:
    import glob
    import shutil

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
    if not _pg_binaries():
        pytest.skip("no PostgreSQL server binaries (pg_ctl): install postgresql to run these")
    import tempfile

    # in memory where possible (CREATE DATABASE per test is 3x faster); right under a sticky
    # world-writable directory, so that the server's own user can reach it
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


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of an empty sweep database: an SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite://{tmp_path}/sweeps.db"
        return
    import uuid

    server: PgServer = request.getfixturevalue("pg_server")
    name = f"test_{uuid.uuid4().hex[:12]}"
    server.admin(f'CREATE DATABASE "{name}"')
    yield server.database_url(name)
    server.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ---- end of the sweep store block -----------------------------------------------------------


# ---- uninterrupted reference runs, one per command for the session (tests/support/reference.py)
from tests.support.reference import reference_runs  # noqa: E402, F401
