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

# the shared fixtures, registered once for every test (tests/support/__init__.py lists them)
pytest_plugins = [
    "tests.support.browser",
    "tests.support.buckets",
    "tests.support.gcs",
    "tests.support.azure_blob",  # after buckets and gcs: it imports them (assertion rewriting)
    "tests.support.cpu",
    "tests.support.env",
    "tests.support.metadata",
    "tests.support.postgres",
    "tests.support.reference",
    "tests.support.signals",
    "tests.support.slurm",
    "tests.support.sweep_queue",
]

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


def process_state(pid: int) -> str | None:
    """The process's state letter in /proc (T: stopped, Z: a zombie); None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2]


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


# the files of lane "frameworks" (tests/services/lanes.sh): each test a framework's fits.
# test_accelerate.py (two accelerate launches, 41 s) runs in lane "rest" instead: measured on a
# fresh clone, the frameworks lane took 14.0 min and the rest 12.5, and the lanes share 2 cores
FRAMEWORK_FILES = frozenset(
    {
        "test_lightning.py",
        "test_lightning_stops.py",
        "test_transformers.py",
        "test_keras_stops.py",
        "test_tf_handler.py",
        "test_distributed.py",
    }
)


def pytest_itemcollected(item: pytest.Item) -> None:
    """A test that submits SLURM jobs runs in the ``waits`` lane (tests/services/lanes.sh): all
    of them in one lane, so that their jobs never queue behind each other on the one node. The
    framework files' tests are marked for the ``frameworks`` lane (test_readme.py marks its
    framework blocks itself)."""
    if "sbatch" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.waits)
    if item.path.name in FRAMEWORK_FILES and item.path.parent.name == "integration":
        item.add_marker(pytest.mark.frameworks)
