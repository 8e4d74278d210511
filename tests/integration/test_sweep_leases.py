"""Leases with fencing, end to end: agents that are *slow* rather than dead (stopped with
SIGSTOP as Ctrl+Z or a frozen VM stops them, cut off from PostgreSQL for longer than their
lease, on a host whose wall clock steps), agents "on two hosts" sharing one checkpoint
directory, and the SQLite file deleted under running agents. Real agents, real runs
(``tests/scripts/lease_train.py``: no torch, it starts in a fraction of a second), real
signals, real databases; every run's steps are logged with the process and the monotonic time,
so that two attempts of one run at once would show, and each resumed run must end with the
value of a run never stopped.

"Another host" is another pid namespace (``unshare --pid``): its agent cannot see the
holder's process, as an agent on another machine cannot, and must go by the lease's times.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from preemptible.sweeps.store._endings import LEASE_MARGIN
from preemptible.sweeps.store._queue import open_store
from tests.conftest import ROOT, SCRIPTS, Child, process_state, wait_for
from tests.scripts.lease_train import expected
from tests.support.postgres import PgServer
from tests.support.sweeps import cli, create

pytestmark = pytest.mark.timeout(180)

TRAIN = str(SCRIPTS / "lease_train.py")
PLAIN = str(SCRIPTS / "plain_steps.py")  # no handler: nothing of its own stops it
FAKE_CLOCK = SCRIPTS / "fakeclock"


def spec(tmp_path: Path, steps: list[int] | int, sleep: float = 0.25, program: str = TRAIN) -> Path:
    values = steps if isinstance(steps, list) else [steps]
    doc = {
        "program": program,
        "method": "grid",
        "parameters": {
            "steps": {"values": values},
            "step-sleep": {"value": sleep},
            "log": {"value": str(tmp_path / "steps.log")},
        },
        "max_failures": 0,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps(doc))
    return path


def agent(
    spawn: Callable[..., Child],
    cwd: Path,
    db: str,
    sweep: str,
    *extra: str,
    heartbeat: float = 0.5,
    lease: float = 4.0,
    prefix: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Child:
    args = ["agent", sweep, "--db", db, "--heartbeat", f"{heartbeat:g}", "--lease", f"{lease:g}"]
    return spawn([*prefix, *cli(*args, *extra)], cwd=cwd, env=env)


def other_host() -> tuple[str, ...]:
    """A prefix that runs an agent in a pid namespace of its own: "another host"."""
    unshare = shutil.which("unshare")
    probe = [unshare or "unshare", "--pid", "--fork", "--mount-proc", "true"]
    if unshare is None or subprocess.run(probe, capture_output=True, timeout=30).returncode:
        pytest.skip("needs unshare --pid --mount-proc (root, or user namespaces) for another host")
    return (unshare, "--pid", "--fork", "--mount-proc", "--kill-child")


def python_path() -> list[str]:
    """This process's PYTHONPATH: a child given one of its own keeps the code under test."""
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def step_log(tmp_path: Path) -> dict[str, dict[int, list[tuple[float, int]]]]:
    """run -> pid -> [(monotonic time, step)], from every process's step lines."""
    runs: dict[str, dict[int, list[tuple[float, int]]]] = defaultdict(lambda: defaultdict(list))
    path = tmp_path / "steps.log"
    for line in path.read_text().splitlines() if path.exists() else []:
        run, pid, at, step = line.split()
        runs[run][int(pid)].append((float(at), int(step)))
    return runs


def assert_never_two_at_once(tmp_path: Path) -> None:
    for run, pids in step_log(tmp_path).items():
        spans = sorted((min(t for t, _ in s), max(t for t, _ in s), pid) for pid, s in pids.items())
        for (_, end, pid), (start, _, nxt) in itertools.pairwise(spans):
            assert end < start, f"run {run}: processes {pid} and {nxt} ran at the same time"


def final_x(home: Path, run_id: str) -> int:
    return int(json.loads((home / "runs" / run_id / "final.json").read_text())["x"])


def stopped(child: Child) -> Iterator[None]:
    """Stop ``child`` as Ctrl+Z in a terminal does (SIGTSTP; the agent only: its run is in a
    process group of its own) until the generator is closed. The agent stops itself between
    two database transactions (``sweeps/_pause.py``; SIGSTOP inside one would keep the other
    agents out of an SQLite file: ``test_sweep_pause``)."""
    os.kill(child.pid, signal.SIGTSTP)
    wait_for(lambda: process_state(child.pid) == "T", 30, "the agent stopped by its SIGTSTP")
    try:
        yield
    finally:
        os.kill(child.pid, signal.SIGCONT)


def outcome(db: str, run_id: str) -> tuple[Any, list[Any]]:
    """The run as the queue has it, and its attempts."""
    with open_store(db) as store:
        return store.run(run_id), store.attempts(run_id)


def lease_ended(db: str, run_id: str, margin: bool) -> bool:
    with open_store(db, create=False) as store:
        run = store.run(run_id)
    if run.lease_expires is None:
        return False
    extra = LEASE_MARGIN * 6.0 if margin else 0.0
    return time.time() > run.lease_expires + extra


# -- the reproduction ------------------------------------------------------------------
@pytest.mark.waits
def test_a_stopped_agent_s_run_that_reaches_its_end_is_finished_after_one_attempt(
    tmp_path: Path, spawn: Callable[..., Child], store_url: str
) -> None:
    """Agent A is stopped (SIGSTOP) near the end of its run, longer than its lease and margin;
    agent B, on the same host, sees A alive and waits (no attempt, no failure); the run reaches
    its last step and exits 0; A, continued, records it: FINISHED after 1 attempt."""
    sweep = create(spawn, tmp_path, store_url, spec(tmp_path, 16))
    run_id = f"{sweep}-0"
    a = agent(spawn, tmp_path, store_url, sweep, heartbeat=1, lease=6)
    a.wait_line(lambda line: line == "step 12", timeout=60)
    pause = stopped(a)
    next(pause)
    b = agent(spawn, tmp_path, store_url, sweep, heartbeat=1, lease=6)
    b.wait_line(lambda line: "is alive (stopped)" in line, timeout=60)
    wait_for(lambda: lease_ended(store_url, run_id, margin=True), 60, "A's lease and margin")
    assert not (tmp_path / ".preemptible/runs" / run_id / "attempt-2").exists()
    pause.close()
    assert a.wait(60) == 0, a.output
    assert b.wait(60) == 0, b.output
    run, attempts = outcome(store_url, run_id)
    assert (run.state, run.preemptions, run.failures) == ("FINISHED", 0, 0)
    assert [(x.number, x.ending, x.exit_code) for x in attempts] == [(1, "FINISHED", 0)]
    assert final_x(tmp_path / ".preemptible", run_id) == expected(16)
    assert "could not start" not in b.output and "attempt 1 of run" not in b.output


@pytest.mark.waits
def test_a_stopped_agent_s_run_stops_itself_before_the_lease_ends_and_resumes_exactly(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    """A is stopped early in a long run: its run watches the lease itself and stops (saves) by
    the lease's deadline, although nothing renews or tells it; B waits while A lives; A,
    continued, records PREEMPTED; the run is resumed once and ends as if never stopped."""
    db = f"sqlite://{tmp_path}/q.db"
    sweep = create(spawn, tmp_path, db, spec(tmp_path, 40))
    run_id = f"{sweep}-0"
    a = agent(spawn, tmp_path, db, sweep)
    a.wait_line(lambda line: line == "step 3", timeout=60)
    pause = stopped(a)
    next(pause)
    stopped_at = time.monotonic()
    b = agent(spawn, tmp_path, db, sweep)
    wait_for(lambda: lease_ended(db, run_id, margin=True), 60, "A's lease and margin")
    [mine] = step_log(tmp_path)[run_id].values()  # one process so far, and it stopped
    last = max(t for t, _ in mine)
    assert last < stopped_at + 4.0 * (1 - LEASE_MARGIN), "the run outlived its lease's deadline"
    record = json.loads(
        (tmp_path / ".preemptible/runs" / run_id / "attempt-1/record.json").read_text()
    )
    assert (record["state"], record["reason"], record["signum"]) == ("stopped", "lease", None)
    pause.close()
    assert a.wait(60) == 0, a.output
    assert b.wait(60) == 0, b.output
    run, attempts = outcome(db, run_id)
    assert (run.state, run.preemptions, run.failures) == ("FINISHED", 1, 0)
    assert [x.ending for x in attempts] == ["PREEMPTED", "FINISHED"]
    assert attempts[0].checkpoint_step is not None and attempts[0].checkpoint_step >= 3
    assert final_x(tmp_path / ".preemptible", run_id) == expected(40)
    assert_never_two_at_once(tmp_path)


# -- two hosts, one checkpoint directory -------------------------------------------------------
@pytest.mark.waits
def test_an_agent_on_another_host_takes_over_only_after_the_stopped_holder_s_run_is_gone(
    tmp_path: Path, spawn: Callable[..., Child], store_url: str
) -> None:
    """Agents with their own --home on one checkpoint directory, B in a pid namespace of its
    own (it cannot see A's processes, as on another machine). A is stopped mid-run; its run
    stops itself before the lease ends; B takes the run over only a margin after the lease
    ended, resumes from the shared checkpoints, and finishes it exactly. A, continued after
    that, finds its lease taken: its result goes on its attempt only, marked late (PREEMPTED,
    as it really ended, not "CRASHED, lost"), and nothing ran twice at once."""
    prefix = other_host()
    sweep = create(spawn, tmp_path, store_url, spec(tmp_path, 40))
    run_id = f"{sweep}-0"
    home_a, home_b = tmp_path / "ha", tmp_path / "hb"
    shared = home_a / "runs" / run_id / "checkpoints"
    shared.mkdir(parents=True)
    (home_b / "runs" / run_id).mkdir(parents=True)
    (home_b / "runs" / run_id / "checkpoints").symlink_to(shared)
    a = agent(spawn, tmp_path, store_url, sweep, "--home", str(home_a))
    a.wait_line(lambda line: line == "step 5", timeout=60)
    pause = stopped(a)
    next(pause)
    b = agent(spawn, tmp_path, store_url, sweep, "--home", str(home_b), prefix=prefix)
    assert b.wait(90) == 0, b.output
    pause.close()
    assert a.wait(60) == 0, a.output
    assert "recorded on the attempt as a late result" in a.output
    run, attempts = outcome(store_url, run_id)
    assert (run.state, run.attempt) == ("FINISHED", 2)
    assert [(x.ending, x.closed_by, x.late) for x in attempts] == [
        ("PREEMPTED", attempts[0].agent, True),
        ("FINISHED", attempts[1].agent, False),
    ]
    assert attempts[0].exit_code is not None
    lost = attempts[0]
    assert lost.ended_at is not None
    assert attempts[1].started_at >= lost.started_at + 4.0  # not before the lease ran out
    assert int(json.loads((shared.parent / "final.json").read_text())["x"]) == expected(40)
    assert_never_two_at_once(tmp_path)
    assert "resuming from" in b.output and "CheckpointLockError" not in a.output + b.output


@contextlib.contextmanager
def frozen(child: Child) -> Iterator[None]:
    """``child`` (an agent alone) stopped by SIGSTOP, as a frozen VM or a paused container
    stops it: no handler of its own runs, its supervisor (a thread of it) is stopped too."""
    os.kill(child.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(child.pid, signal.SIGCONT)


@pytest.mark.waits
@pytest.mark.parametrize(
    ("shared_home", "ctrl_z"), [(False, False), (True, True)], ids=["own-homes", "shared-home"]
)
def test_a_frozen_agent_s_plain_program_is_fenced_before_another_pid_namespace_takes_it_over(
    tmp_path: Path, spawn: Callable[..., Child], shared_home: bool, ctrl_z: bool
) -> None:
    """Agent A is frozen (SIGSTOP; with the shared home, Ctrl+Z: it stops itself) while its
    run, a plain script with no handler, trains; agent B runs in a pid namespace of its own
    (it cannot see A's processes, as on another host).
    A's guardian stops the script by the lease before B may take the run over: the two never
    run at once. With a shared --home, B waits for A's supervisor (it cannot tell whether that
    pid lives) instead of calling it gone. A, continued, records its attempt as it ended
    (PREEMPTED by the fence, late); the run is FINISHED once, by one attempt that ran to its
    end."""
    prefix = other_host()
    db = f"sqlite://{tmp_path}/q.db"
    sweep = create(spawn, tmp_path, db, spec(tmp_path, 36, sleep=0.2, program=PLAIN))
    run_id = f"{sweep}-0"
    home_a = tmp_path / "ha"
    home_b = home_a if shared_home else tmp_path / "hb"
    a = agent(spawn, tmp_path, db, sweep, "--home", str(home_a))
    a.wait_line(lambda line: line == "step 2", timeout=60)
    halt = contextlib.contextmanager(stopped) if ctrl_z else frozen
    with halt(a):
        b = agent(spawn, tmp_path, db, sweep, "--home", str(home_b), prefix=prefix)
        if shared_home:  # A's supervisor holds the run's lock while it is frozen
            b.wait_line(lambda line: "supervisor holds" in line or "supervised by" in line, 60)
        else:
            b.wait_line(lambda line: line == "step 3", timeout=60)
    assert a.wait(60) == 0, a.output
    assert b.wait(90) == 0, b.output
    assert "is gone" not in b.output
    assert_never_two_at_once(tmp_path)
    run, attempts = outcome(db, run_id)
    assert run.state == "FINISHED", attempts
    first = attempts[0]
    assert (first.ending, first.late, first.closed_by) == ("PREEMPTED", True, first.agent)
    assert [x.ending for x in attempts[1:]] == ["FINISHED"]
    assert "the guardian stops it: SIGTERM" in a.output
    ran = step_log(tmp_path)[run_id]
    assert sorted(max(s for _, s in steps) for steps in ran.values())[-1] == 35
    assert sum(max(s for _, s in steps) == 35 for steps in ran.values()) == 1


# -- an outage longer than the lease -----------------------------------------------------------
@pytest.mark.waits
@pytest.mark.timeout(240)
def test_runs_that_finish_while_postgresql_is_down_past_their_lease_are_not_run_again(
    own_pg_server: PgServer, spawn: Callable[..., Child], tmp_path: Path
) -> None:
    """PostgreSQL stopped for longer than the lease and its margin while agent A's run
    finishes and agent B's ("another host") is still training: B's run stops itself before
    its lease ends; A's result is recorded when the server is back (B, after an outage of its
    own, gives holders elsewhere a lease to report first): run 0 FINISHED after its one
    attempt, never run again; run 1 resumed once, exactly."""
    pg_server = own_pg_server  # stopped below: not the one the other lane's tests use
    prefix = other_host()
    db = pg_server.database_url("postgres")
    env = {"PREEMPTIBLE_DB_RETRY_TIMEOUT": "120"}
    down = False
    try:
        sweep = create(spawn, tmp_path, db, spec(tmp_path, [20, 40]))
        # a heartbeat of 1 s: a run is told to stop 2.5 s after its last renewal
        a = agent(spawn, tmp_path, db, sweep, heartbeat=1, lease=5, env=env)
        a.wait_line(lambda line: line == "step 1", timeout=60)
        b = agent(spawn, tmp_path, db, sweep, heartbeat=1, lease=5, prefix=prefix, env=env)
        b.wait_line(lambda line: line == "step 1", timeout=60)
        a.wait_line(lambda line: line == "step 16", timeout=60)  # 1 s of run 0 left
        pg_server.stop()
        down, since = True, time.monotonic()
        a.wait_line(lambda line: "FINISHED (exit 0)" in line, timeout=60)  # during the outage
        b.wait_line(lambda line: "PREEMPTED (exit 143)" in line, timeout=60)
        wait_for(lambda: time.monotonic() - since > 5.0 * (1 + LEASE_MARGIN) + 1, 30, "the outage")
        pg_server.start()
        down = False
        assert a.wait(120) == 0, a.output
        assert b.wait(120) == 0, b.output
        with open_store(db) as store:
            runs = {r.index: r for r in store.runs(sweep)}
            history = {i: store.attempts(r.id) for i, r in runs.items()}
        assert [(x.ending, x.closed_by) for x in history[0]] == [("FINISHED", history[0][0].agent)]
        assert runs[0].state == "FINISHED" and runs[0].preemptions == 0
        assert [x.ending for x in history[1]] == ["PREEMPTED", "FINISHED"]
        assert runs[1].state == "FINISHED"
        home = tmp_path / ".preemptible"
        assert final_x(home, runs[0].id) == expected(20)
        assert final_x(home, runs[1].id) == expected(40)
        steps = step_log(tmp_path)
        assert len(steps[runs[0].id]) == 1  # one process ever ran run 0
        assert_never_two_at_once(tmp_path)
    finally:
        if down:
            pg_server.start()  # before the database is dropped


# -- a host whose wall clock steps -------------------------------------------------------------
@pytest.mark.waits
def test_a_step_of_the_host_s_wall_clock_neither_stops_nor_doubles_a_run(
    tmp_path: Path, spawn: Callable[..., Child], store_url: str
) -> None:
    """The wall clock of the agents' host (both agents and their runs) steps 120 s ahead in the
    middle of a run, then 240 s back. On SQLite, whose clock is the host's, the running lease
    looks long expired to agent B: B sees its holder alive and waits. The run's own deadline
    is on the monotonic clock, which no step moves: FINISHED after 1 attempt, no preemption."""
    offset = tmp_path / "clock-offset"
    offset.write_text("0")
    env = {
        "FAKE_CLOCK_OFFSET_FILE": str(offset),
        "PYTHONPATH": os.pathsep.join([str(FAKE_CLOCK), *python_path(), str(ROOT)]),
    }
    sweep = create(spawn, tmp_path, store_url, spec(tmp_path, 24))
    run_id = f"{sweep}-0"
    a = agent(spawn, tmp_path, store_url, sweep, env=env)
    a.wait_line(lambda line: line == "step 2", timeout=60)
    b = agent(spawn, tmp_path, store_url, sweep, env=env)
    b.wait_line(lambda line: "on sweep" in line, timeout=60)
    offset.write_text("120")
    a.wait_line(lambda line: line == "step 12", timeout=60)
    offset.write_text("-120")
    assert a.wait(90) == 0, a.output
    assert b.wait(90) == 0, b.output
    run, attempts = outcome(store_url, run_id)
    assert (run.state, run.preemptions, run.failures) == ("FINISHED", 0, 0)
    assert [x.ending for x in attempts] == ["FINISHED"]
    assert final_x(tmp_path / ".preemptible", run_id) == expected(24)
    assert "lease" not in "".join(line for line in a.lines if "notice" in line)


@pytest.mark.waits
def test_an_agent_whose_wall_clock_runs_ahead_takes_no_healthy_run_over_on_sqlite(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    """Agent B's wall clock runs 600 s ahead of agent A's (an injected clock for B alone;
    libfaketime breaks Python's sleep here: ``tests/scripts/fakeclock``), and B is on "another
    host" (a pid namespace of its own: it cannot see A alive). On SQLite each process's own
    wall clock is the database's "now", so A's healthy lease looks 600 s expired to B; B must
    go by A's renewals on its own clock instead and take nothing over: FINISHED after one
    attempt, no preemption, A's run never killed."""
    prefix = other_host()
    offset = tmp_path / "clock-offset"
    offset.write_text("600")
    paths = [str(FAKE_CLOCK), *python_path(), str(ROOT)]
    env = {"FAKE_CLOCK_OFFSET_FILE": str(offset), "PYTHONPATH": os.pathsep.join(paths)}
    db = f"sqlite://{tmp_path}/q.db"
    sweep = create(spawn, tmp_path, db, spec(tmp_path, 30, sleep=0.2))
    run_id = f"{sweep}-0"
    a = agent(spawn, tmp_path, db, sweep, "--home", str(tmp_path / "ha"))
    a.wait_line(lambda line: line == "step 1", timeout=60)
    b = agent(spawn, tmp_path, db, sweep, "--home", str(tmp_path / "hb"), prefix=prefix, env=env)
    assert a.wait(60) == 0, a.output
    assert b.wait(60) == 0, b.output
    assert "lost its agent" not in b.output and "took the run over" not in a.output
    run, attempts = outcome(db, run_id)
    assert (run.state, run.preemptions, run.failures) == ("FINISHED", 0, 0)
    assert [(x.ending, x.exit_code) for x in attempts] == [("FINISHED", 0)]
    assert final_x(tmp_path / "ha", run_id) == expected(30)


# -- the SQLite file deleted under running agents ----------------------------------------------
@pytest.mark.waits
def test_the_sqlite_file_deleted_under_running_agents_stops_each_with_one_line(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    """Two agents run two runs; the database file is deleted. Each agent stops its run (it
    saves) and exits 2 with one line naming the file; no new empty database appears (the
    heartbeat threads' connections create nothing); ``status`` says the file is not there."""
    path = tmp_path / "q.db"
    db = f"sqlite://{path}"
    sweep = create(spawn, tmp_path, db, spec(tmp_path, [400, 401]))
    a = agent(spawn, tmp_path, db, sweep)
    a.wait_line(lambda line: line == "step 1", timeout=60)
    b = agent(spawn, tmp_path, db, sweep)
    b.wait_line(lambda line: line == "step 1", timeout=60)
    a.wait_line(lambda line: line == "step 4", timeout=60)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    for child in (a, b):
        assert child.wait(60) == 2, child.output
        said = [line for line in child.lines if line.startswith("preemptible: the sweep data")]
        assert said == [
            f"preemptible: the sweep database {db} was deleted while in use; nothing is "
            "recreated (put the file back, or create a new sweep with `preemptible sweep create`)"
        ], child.output
    assert not path.exists()
    for run in (tmp_path / ".preemptible" / "runs").iterdir():
        assert list((run / "checkpoints").glob("step-*")), f"{run.name} did not save"
    status = spawn(cli("status", "--db", db), cwd=tmp_path)
    assert status.wait(60) == 2
    assert f"no sweep database at {db} (deleted" in status.output
    assert "no sweeps yet" not in status.output and not path.exists()
    assert_never_two_at_once(tmp_path)
