"""Nothing the job starts outlives its attempt: not a daemon that left the process group with
``setsid()``, not a background process left in the group, not after ``kill -9`` of the
supervisor either."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import PY, attempts, read_pid, supervise, wait_for

pytestmark = pytest.mark.timeout(60)

# Forks a daemon (double fork + setsid) that writes its pid to argv[1] and sleeps forever;
# then the job itself exits 0, or waits for a signal with "wait".
DAEMON = """
import os, signal, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # it takes a SIGKILL
        with open(sys.argv[1] + ".tmp", "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        while True:
            signal.pause()
    os._exit(0)
os.wait()
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
print("daemon up", flush=True)
if sys.argv[2:] == ["wait"]:
    signal.pause()
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.fixture
def strays() -> Iterator[list[int]]:
    """Pids to SIGKILL at teardown, in case a test fails with them still running."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def test_a_daemon_that_left_the_group_ends_with_the_attempt(
    tmp_path: Path, spawn, strays: list[int]
) -> None:
    pid_file = tmp_path / "daemon.pid"
    sup = supervise(spawn, tmp_path, "--", PY, "-c", DAEMON, str(pid_file))
    daemon = read_pid(pid_file)
    strays.append(daemon)
    assert sup.wait(30) == 0, sup.output
    assert not alive(daemon), sup.output
    assert f"process(es) the job left running outside its process group (pids {daemon})" in (
        sup.output
    )
    [a] = attempts(tmp_path)
    assert a["state"] == "FINISHED"


def test_kill_9_of_the_supervisor_takes_the_daemon_too(
    tmp_path: Path, spawn, strays: list[int]
) -> None:
    pid_file = tmp_path / "daemon.pid"
    sup = supervise(spawn, tmp_path, "--", PY, "-c", DAEMON, str(pid_file), "wait")
    daemon = read_pid(pid_file)
    strays.append(daemon)
    group = os.getpgid(daemon)  # the session the daemon's parent made with setsid()
    sup.wait_line(lambda line: f"started process group {group} outside its own" in line, 30)
    sup.proc.kill()  # SIGKILL: only the guardian is left to clean up
    wait_for(lambda: not alive(daemon), 10, "the daemon to be killed by the guardian")


def test_a_background_process_left_in_the_group_does_not_hold_the_attempt(
    tmp_path: Path, spawn, strays: list[int]
) -> None:
    bg = tmp_path / "bg.pid"
    script = f"sleep 1000 & echo $! > {bg}.tmp; mv {bg}.tmp {bg}; exit 0"
    started = time.monotonic()
    sup = supervise(spawn, tmp_path, "--", "bash", "-c", script)
    sleeper = read_pid(bg)
    strays.append(sleeper)
    assert sup.wait(30) == 0, sup.output
    assert 4.5 < time.monotonic() - started < 20
    assert not alive(sleeper)
    assert "processes it started in its group are still running" in sup.output
    assert "sending them SIGTERM" in sup.output and "sending them SIGKILL" not in sup.output
    [a] = attempts(tmp_path)
    assert (a["state"], a["ending"]) == ("FINISHED", "exit 0")
