"""Nothing the job starts outlives its attempt: not a daemon that left the process group with
``setsid()``, not torchrun's workers (each in a session of its own), not a background process
left in the group, not after ``kill -9`` of the supervisor, of its guardian, or of both.

Where it matters the tests run under both containments: a cgroup v2 per attempt (where this
machine lets us make one) and the /proc guardian (``PREEMPTIBLE_CONTAINMENT=proc``). "Left
running" is judged independently of the code under test: every process whose environment
names a run directory under the test's tmp_path (every process of every attempt inherits
``PREEMPTIBLE_RUN_DIR``), and the pids seen before the kill, with their start times.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from preemptible.supervisor._cgroup import probe
from tests.conftest import PY, SCRIPTS, attempts, python_args, read_pid, supervise, wait_for

pytestmark = pytest.mark.timeout(90)

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
CGROUPS = probe().kind == "cgroup"

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


# -- looking at processes, independently of the code under test ----------------------------------
def stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def start_time(pid: int) -> int | None:
    fields = stat(pid)
    return None if fields is None or fields[0] == "Z" else int(fields[19])


def alive(pid: int) -> bool:
    return start_time(pid) is not None


def all_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def tree(root: int) -> dict[int, int]:
    """``root`` and its descendants now: pid -> start time."""
    parents = {}
    for pid in all_pids():
        fields = stat(pid)
        if fields is not None and fields[0] != "Z":
            parents[pid] = (int(fields[1]), int(fields[19]))
    found = {root: parents[root][1]} if root in parents else {}
    grew = True
    while grew:
        grew = False
        for pid, (ppid, start) in parents.items():
            if ppid in found and pid not in found:
                found[pid] = start
                grew = True
    return found


def of_the_test(tmp_path: Path) -> dict[int, int]:
    """Running processes of any attempt of a run under ``tmp_path``: pid -> start time."""
    mark = f"PREEMPTIBLE_RUN_DIR={tmp_path}".encode()
    found = {}
    for pid in all_pids():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        start = start_time(pid)
        if start is not None and any(e.startswith(mark) for e in env):
            found[pid] = start
    return found


def still_running(seen: dict[int, int]) -> dict[int, int]:
    return {pid: start for pid, start in seen.items() if start_time(pid) == start}


def guardians(supervisor: int) -> list[int]:
    found = []
    for pid in tree(supervisor):
        with contextlib.suppress(OSError):
            if b"_guard.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def the_guardian(supervisor: int) -> int:
    """The pid of the supervisor's one guardian, once it runs its script: the supervisor starts
    it just after the job, so a quick job can be ready before it is."""
    found: list[int] = []

    def one() -> bool:
        found[:] = guardians(supervisor)
        return len(found) == 1

    wait_for(one, 10, "the attempt's guardian to run")
    return found[0]


def removed(path: Path) -> bool:
    """Whether ``path`` is gone after one try (a file made or removed in it while it was being
    removed fails the try)."""
    with contextlib.suppress(OSError):
        shutil.rmtree(path)
    return not path.exists()


def cgroups_left() -> list[str]:
    here = probe()
    if here.parent is None:
        return []
    return [p.name for p in here.parent.iterdir() if p.name.startswith("preemptible.")]


@pytest.fixture
def strays(tmp_path: Path) -> Iterator[dict[int, int]]:
    """Processes to SIGKILL at teardown (pid -> start time), with every process of the
    test's attempts, in case a test fails with them still running."""
    seen: dict[int, int] = {}
    yield seen
    for pid, start in {**seen, **of_the_test(tmp_path)}.items():
        if start_time(pid) == start:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(
    params=[
        pytest.param(
            "cgroup",
            marks=pytest.mark.skipif(not CGROUPS, reason="no cgroup v2 can be made here"),
        ),
        "proc",
    ]
)
def containment(request: pytest.FixtureRequest) -> dict[str, str]:
    return {"PREEMPTIBLE_CONTAINMENT": str(request.param)}


def gone_within(seconds: float, tmp_path: Path, seen: dict[int, int]) -> None:
    wait_for(
        lambda: not still_running(seen) and not of_the_test(tmp_path),
        seconds,
        "every process of the attempt to be gone",
    )


# -- the tests -----------------------------------------------------------------------------------
def test_a_daemon_that_left_the_group_ends_with_the_attempt(
    tmp_path: Path, spawn, strays: dict[int, int]
) -> None:
    pid_file = tmp_path / "daemon.pid"
    sup = supervise(spawn, tmp_path, "--", PY, "-c", DAEMON, str(pid_file))
    daemon = read_pid(pid_file)
    strays[daemon] = start_time(daemon) or 0
    assert sup.wait(30) == 0, sup.output
    assert not alive(daemon), sup.output
    assert f"process(es) the job left running outside its process group (pids {daemon})" in (
        sup.output
    )
    [a] = attempts(tmp_path)
    assert a["state"] == "FINISHED"


def test_kill_9_of_the_supervisor_takes_the_daemon_too(
    tmp_path: Path, spawn, strays: dict[int, int], containment: dict[str, str]
) -> None:
    pid_file = tmp_path / "daemon.pid"
    sup = supervise(spawn, tmp_path, "--", PY, "-c", DAEMON, str(pid_file), "wait", env=containment)
    daemon = read_pid(pid_file)
    strays[daemon] = start_time(daemon) or 0
    group = os.getpgid(daemon)  # the session the daemon's parent made with setsid()
    sup.wait_line(lambda line: f"started process group {group} outside its own" in line, 30)
    sup.proc.kill()  # SIGKILL: only the guardian is left to clean up
    wait_for(lambda: not alive(daemon), 10, "the daemon to be killed by the guardian")


def test_a_background_process_left_in_the_group_does_not_hold_the_attempt(
    tmp_path: Path, spawn, strays: dict[int, int]
) -> None:
    bg = tmp_path / "bg.pid"
    script = f"sleep 1000 & echo $! > {bg}.tmp; mv {bg}.tmp {bg}; exit 0"
    started = time.monotonic()
    sup = supervise(spawn, tmp_path, "--", "bash", "-c", script)
    sleeper = read_pid(bg)
    strays[sleeper] = start_time(sleeper) or 0
    assert sup.wait(30) == 0, sup.output
    assert 4.5 < time.monotonic() - started < 20
    assert not alive(sleeper)
    assert "processes it started in its group are still running" in sup.output
    assert "sending them SIGTERM" in sup.output and "sending them SIGKILL" not in sup.output
    [a] = attempts(tmp_path)
    assert (a["state"], a["ending"]) == ("FINISHED", "exit 0")


def test_kill_9_of_preemptible_run_over_torchrun_leaves_no_process(
    tmp_path: Path, spawn, strays: dict[int, int], containment: dict[str, str]
) -> None:
    """The issue's reproduction: torchrun starts each worker in a session of its own, where
    neither the group kill nor a watch of the supervisor's own children reaches; after
    ``kill -9`` of ``preemptible run`` not one of its processes is left."""
    job = [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "ddp_train.py")]
    job += ["--ckpt", "ck", "--out", "o.pt", "--steps", "100000", "--step-sleep", "0.05"]
    env = {**containment, "OMP_NUM_THREADS": "1"}
    sup = supervise(spawn, tmp_path, "--", *job, env=env)
    for rank in (0, 1):
        sup.wait_line(lambda line, r=rank: f"rank {r} step 2" in line, 120)
    seen = tree(sup.pid)
    strays.update(seen)
    workers = [pid for pid in of_the_test(tmp_path) if b"ddp_train" in cmdline(pid)]
    assert len(workers) >= 2, (seen, sup.output)
    torchrun = _parent(workers[0])
    assert all(os.getsid(w) not in (os.getsid(torchrun), os.getsid(sup.pid)) for w in workers)
    sup.proc.kill()
    gone_within(20, tmp_path, seen)
    assert not [name for name in cgroups_left() if "ddp" in name or "torchrun" in name]


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _parent(pid: int) -> int:
    fields = stat(pid)
    assert fields is not None
    return int(fields[1])


def test_a_killed_guardian_is_replaced_and_kill_9_of_the_supervisor_then_leaves_nothing(
    tmp_path: Path, spawn, strays: dict[int, int]
) -> None:
    pid_file = tmp_path / "daemon.pid"
    env = {"PREEMPTIBLE_CONTAINMENT": "proc"}
    sup = supervise(spawn, tmp_path, "--", PY, "-c", DAEMON, str(pid_file), "wait", env=env)
    daemon = read_pid(pid_file)
    first = the_guardian(sup.pid)
    os.kill(first, signal.SIGKILL)
    line = sup.wait_line(lambda line: f"guardian of attempt 1 (pid {first}) died" in line, 30)
    assert "killed by SIGKILL" in line
    second = int(re.findall(r"started another \(pid (\d+)\)", line)[0])
    # the line comes right after the fork: the new guardian is ours once it has exec'd its
    # script (seen in CI: found none a moment earlier, on main before this stop too)
    wait_for(lambda: guardians(sup.pid) == [second], 10, "the new guardian to run its script")
    seen = tree(sup.pid)
    strays.update(seen)
    assert daemon in of_the_test(tmp_path)
    sup.proc.kill()
    gone_within(15, tmp_path, seen)


def test_sigkill_of_the_guardian_and_the_supervisor_together_stops_the_run_with_a_save(
    tmp_path: Path, spawn, strays: dict[int, int]
) -> None:
    """Nobody is left to kill the trainer: it sees its run's lock go, saves at the next step
    and exits, releasing the checkpoint lock."""
    env = {"PREEMPTIBLE_CONTAINMENT": "proc", "PREEMPTIBLE_POLL_INTERVAL": "0.2"}
    job = python_args("light_train.py", "--ckpt", "ck", "--steps", "100000")
    sup = supervise(spawn, tmp_path, "--", *job, env=env)
    sup.wait_line(lambda line: line == "step 5", 60)
    guardian = the_guardian(sup.pid)
    seen = tree(sup.pid)
    strays.update(seen)
    sup.signal(signal.SIGSTOP)  # so that it cannot replace its guardian in between
    os.kill(guardian, signal.SIGKILL)
    sup.signal(signal.SIGKILL)
    gone_within(30, tmp_path, seen)
    stopped = [line for line in sup.lines if "stopped at step" in line]
    assert stopped and "supervisor" in stopped[0], sup.output
    [saved] = [int(p.name[5:-5]) for p in (tmp_path / "ck").glob("step-*.ckpt")]
    assert saved >= 6, saved  # the next attempt resumes from it: the agent test below


def test_the_next_supervisor_stops_what_an_attempt_left_when_both_were_killed(
    tmp_path: Path, spawn, strays: dict[int, int], containment: dict[str, str]
) -> None:
    """A job that does not watch its supervisor (no handler): after SIGKILL of the
    supervisor and its guardian together it runs on; the same command again stops it
    (SIGTERM) before its own attempt starts."""
    script = (
        "if [ -e again ]; then exit 0; fi; touch again; "
        "sleep 1000 & echo $! > sleeper.tmp; mv sleeper.tmp sleeper; wait"
    )
    sup = supervise(spawn, tmp_path, "--", "bash", "-c", script, env=containment)
    sleeper = read_pid(tmp_path / "sleeper")
    seen = tree(sup.pid)
    strays.update(seen)
    guardian = the_guardian(sup.pid)
    sup.signal(signal.SIGSTOP)
    os.kill(guardian, signal.SIGKILL)
    sup.signal(signal.SIGKILL)
    wait_for(lambda: not alive(sup.pid), 10, "the supervisor to be gone")
    assert alive(sleeper)  # nobody watches it: left to the next supervisor
    again = supervise(spawn, tmp_path, "--", "bash", "-c", script, env=containment)
    assert again.wait(60) == 0, again.output
    assert "of an earlier attempt of run" in again.output, again.output
    assert f"pids {sleeper}" in again.output or str(sleeper) in again.output
    assert not still_running(seen) and not of_the_test(tmp_path)
    # the killed attempt, which its supervisor never journaled, is journaled by the next one:
    # lost, and CRASHED (nothing marked it preempting)
    first, second = attempts(tmp_path)
    assert (first["attempt"], first["state"], first["ending"]) == (1, "CRASHED", "lost")
    assert "attempt 1 of run" in again.output and "ended unseen" in again.output
    assert second["attempt"] == 2 and second["state"] == "FINISHED"
    assert not [n for n in cgroups_left() if n.startswith("preemptible.bash-")]


def test_sigkill_of_the_guardian_and_the_agent_then_the_next_agent_resumes(
    tmp_path: Path, spawn, strays: dict[int, int]
) -> None:
    """The issue's other reproduction, under an agent: SIGKILL of the guardian and then the
    agent leaves no process (the run saves and stops itself), and the next agent's attempt
    resumes from that save instead of failing on the checkpoint lock."""
    from preemptible.sweeps.store._queue import open_store

    db = f"sqlite://{tmp_path}/q.db"
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        json.dumps(
            {
                "program": str(SCRIPTS / "light_train.py"),
                "method": "grid",
                "parameters": {"steps": {"value": 40}, "step-sleep": {"value": 0.05}},
            }
        )
    )
    cli = [PY, "-m", "preemptible"]
    created = spawn([*cli, "sweep", "create", str(spec), "--db", db], cwd=tmp_path)
    assert created.wait(60) == 0, created.output
    sweep = created.lines[-1].strip()
    agent = [*cli, "agent", sweep, "--db", db, "--heartbeat", "0.5", "--lease", "3"]
    env = {"PREEMPTIBLE_CONTAINMENT": "proc", "PREEMPTIBLE_POLL_INTERVAL": "0.2"}
    a = spawn(agent, cwd=tmp_path, env=env)
    a.wait_line(lambda line: line == "step 5", 60)
    guardian = the_guardian(a.pid)
    seen = tree(a.pid)
    strays.update(seen)
    a.signal(signal.SIGSTOP)
    os.kill(guardian, signal.SIGKILL)
    a.signal(signal.SIGKILL)
    gone_within(30, tmp_path, seen)
    b = spawn(agent, cwd=tmp_path, env=env)
    assert b.wait(120) == 0, b.output
    assert "CheckpointLockError" not in b.output and "is locked" not in b.output, b.output
    assert "resuming from" in b.output, b.output
    with open_store(db) as store:
        [run] = store.runs(sweep)
    assert run.state == "FINISHED", run


def test_a_supervisor_given_a_deleted_run_directory_leaves_the_first_one_s_job_alone(
    tmp_path: Path, spawn, strays: dict[int, int]
) -> None:
    """The run directory deleted under a running supervisor lets a second one take the run
    (a new lock file) with the same attempt directory: the first one's job is supervised,
    not an orphan, and neither supervisor stops the other's job."""
    job = [PY, "-c", "import os, time; print('job', os.getpid(), flush=True); time.sleep(600)"]
    first = supervise(spawn, tmp_path, "--", *job)
    one = int(first.wait_line(lambda line: line.startswith("job "), 30).split()[1])
    strays[one] = start_time(one) or 0
    # the supervisor may still be writing in it (its attempt's files): remove until it is gone
    wait_for(lambda: removed(tmp_path / ".preemptible"), 10, "the run directory to be removed")
    second = supervise(spawn, tmp_path, "--", *job)
    two = int(second.wait_line(lambda line: line.startswith("job "), 30).split()[1])
    strays[two] = start_time(two) or 0
    assert "of an earlier attempt" not in second.output
    first.signal(signal.SIGTERM)
    assert first.wait(30) == 143, first.output
    assert alive(two) and not alive(one)
    second.signal(signal.SIGTERM)
    assert second.wait(30) == 143, second.output
