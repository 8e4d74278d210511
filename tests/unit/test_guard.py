"""The process-tree primitives of the guardian, on real processes: a pid is signalled only
with its start time, the tracker follows descendants into sessions of their own and never
adopts a stranger, the kill takes the whole tree, an environment entry matches exactly; and the
trainer's watch of its supervisor's lock (``SupervisorGone``)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from preemptible.notices._lease import write_lease
from preemptible.notices._supervised import SupervisorGone, for_this_attempt
from preemptible.supervisor._guard import (
    FENCE_NAME,
    NOTICE_SLACK,
    Fence,
    Tracker,
    kill_tree,
    marked,
    processes,
    read_proc,
    signal_process,
)
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(60)

# a child in a session of its own (as torchrun starts its workers), which prints its pid
TREE = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        p.wait(10)


def start(procs: list[subprocess.Popen[str]], code: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    procs.append(p)
    return p


def running(pid: int) -> bool:
    found = read_proc(pid)
    return found is not None and not found.zombie


def test_a_pid_is_signalled_only_with_its_start_time(procs: list[subprocess.Popen[str]]) -> None:
    p = start(procs, "import time; time.sleep(600)")
    me = read_proc(p.pid)
    assert me is not None
    assert not signal_process(p.pid, me.start + 1, signal.SIGKILL)  # another process's
    assert running(p.pid)
    assert signal_process(p.pid, me.start, signal.SIGKILL)
    p.wait(10)
    assert not signal_process(p.pid, me.start, signal.SIGKILL)  # gone


def test_the_tracker_follows_a_new_session_and_kill_tree_takes_it(
    procs: list[subprocess.Popen[str]],
) -> None:
    stranger = start(procs, "import time; time.sleep(600)")  # not the job's
    job = start(procs, TREE)
    assert job.stdout is not None
    worker = int(job.stdout.readline())
    assert os.getsid(worker) == worker != os.getsid(job.pid)
    tracker = Tracker(supervisor=os.getpid(), job=job.pid)
    wait_for(lambda: worker in (tracker.poll(), tracker.members)[1], 10, "the worker")
    assert job.pid in tracker.members and stranger.pid not in tracker.members
    killed = kill_tree(tracker, markers=[], protect=[os.getpgrp()], deadline=10)
    assert {job.pid, worker} <= set(killed) and stranger.pid not in killed
    job.wait(10)
    wait_for(lambda: not running(worker), 10, "the worker to be gone")
    assert running(stranger.pid)


def test_an_environment_entry_matches_exactly(procs: list[subprocess.Popen[str]]) -> None:
    env = {**os.environ, "PREEMPTIBLE_ATTEMPT_TOKEN": "10.20.30"}
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)
    procs.append(p)  # type: ignore[arg-type]
    table = processes().values()
    assert p.pid not in marked(table, [b"PREEMPTIBLE_ATTEMPT_TOKEN=10.20.3"], spare=set())
    assert p.pid in marked(table, [b"x=1", b"PREEMPTIBLE_ATTEMPT_TOKEN=10.20.30"], spare=set())
    prefix = b"PREEMPTIBLE_ATTEMPT_TOKEN=10.20."
    assert p.pid in marked(table, [prefix], spare=set(), prefix=True)
    assert p.pid not in marked(table, [prefix], spare={p.pid}, prefix=True)
    assert not marked(table, [], spare=set())


def test_supervisor_gone_arms_on_a_held_lock_and_fires_after_two_looks(tmp_path: Path) -> None:
    (tmp_path / "attempt-1").mkdir()
    lock = tmp_path / "supervisor.lock"
    lock.write_text("")
    source = for_this_attempt(str(tmp_path / "attempt-1"))
    assert isinstance(source, SupervisorGone)
    assert source.poll() is None  # never held yet: not armed (a lock /proc/locks cannot show)
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    assert source.poll() is None
    os.close(fd)  # the supervisor and its guardian are gone
    assert source.poll() is None  # one look is not enough
    notice = source.poll()
    assert notice is not None and notice.source == "supervisor" and notice.deadline is None
    fd = os.open(lock, os.O_RDWR)  # the source never took the lock: it is free to take
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)


def test_supervisor_gone_follows_the_lock_s_file_not_its_name(tmp_path: Path) -> None:
    """The run directory deleted under a running supervisor is not its death."""
    lock = tmp_path / "supervisor.lock"
    lock.write_text("")
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    source = SupervisorGone(lock)
    assert source.poll() is None
    lock.unlink()
    assert source.poll() is None and source.poll() is None and source.poll() is None
    os.close(fd)
    assert source.poll() is None
    assert source.poll() is not None


def test_no_source_without_a_supervisor_lock(tmp_path: Path) -> None:
    assert for_this_attempt(None) is None
    assert for_this_attempt(str(tmp_path / "attempt-1")) is None


def test_a_guardian_that_cannot_run_is_replaced_a_few_times_then_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from preemptible.supervisor import _process

    broken = tmp_path / "guard.py"
    broken.write_text("import sys; sys.exit(3)\n")
    monkeypatch.setattr(_process, "GUARD_SCRIPT", str(broken))
    group = _process.ProcessGroup(["sleep", "60"], env=dict(os.environ))
    try:
        seen = []
        while len(seen) < 4:
            replaced = group.keep_guardian()
            if replaced is not None:
                seen.append(replaced)
            time.sleep(0.01)
        assert [r[1] for r in seen] == [3, 3, 3, 3]
        assert all(r[2] is not None for r in seen[:3]) and seen[3][2] is None
        assert group.keep_guardian() is None  # given up: said once
        assert len(group.guardians) == 1 + _process.MAX_GUARDIAN_CRASHES
    finally:
        group.kill_all()
        group.proc.wait(10)


# -- the lease fence ----------------------------------------------------------------------------
def test_the_fence_follows_the_lease_file_and_renewals_move_it(tmp_path: Path) -> None:
    """SIGTERM a poll of the program's own notice after the self-stop point, SIGKILL at the
    deadline or a term timeout after the SIGTERM; a renewal (the file rewritten) moves both; a
    garbled file keeps the deadline last read; a guardian that replaces one that sent the
    SIGTERM sends no second one."""
    lease = tmp_path / "lease.json"
    now = time.monotonic()
    keys = {"run_id": "r", "attempt": 1, "epoch": 1, "margin": 2.0}
    write_lease(lease, deadline=now + 8.0, warn=4.0, **keys)
    fence = Fence(lease, term_timeout=30.0, run="r")
    fence.read()
    assert fence.due(now) is None
    assert fence.due(now + 4.0) is None  # the self-stop point: the program's own notice
    assert fence.due(now + 4.0 + NOTICE_SLACK) == signal.SIGTERM
    assert fence.due(now + 8.0) == signal.SIGKILL
    write_lease(lease, deadline=now + 18.0, warn=4.0, **keys)  # renewed
    fence.read()
    assert fence.due(now + 8.0) is None
    lease.write_text("{not json")
    fence.read()
    assert fence.due(now + 18.0) == signal.SIGKILL
    fence.termed(now + 15.5, sent=True)
    assert fence.due(now + 16.0) is None
    assert json.loads((tmp_path / FENCE_NAME).read_text())["term_monotonic"] == now + 15.5
    again = Fence(lease, term_timeout=1.0, run="r")  # a replaced guardian
    write_lease(lease, deadline=now + 18.0, warn=4.0, **keys)
    again.read()
    assert again.due(now + 16.0) is None  # no second SIGTERM
    assert again.due(now + 16.6) == signal.SIGKILL  # a term timeout after the first one


def test_the_fence_sends_no_sigterm_to_a_program_that_is_stopping(tmp_path: Path) -> None:
    fence = Fence(tmp_path / "lease.json", term_timeout=30.0)
    assert not fence.stopping()
    (tmp_path / "record.json").write_text(json.dumps({"state": "stopping", "reason": "lease"}))
    assert fence.stopping()
