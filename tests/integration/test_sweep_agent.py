"""``preemptible agent`` end to end: real agents (processes), real runs, real signals, a real
queue (SQLite, and PostgreSQL where marked), states read back from the store. The runs are
``tests/scripts/lease_train.py`` (no torch: it starts in a fraction of a second; a resumed run
must end with the value of a run never stopped); ``preemptible demo`` (test_sweep_demo.py)
resumes torch runs through agents bit for bit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from preemptible.sweeps.store._queue import open_store
from tests.conftest import SCRIPTS, Child, wait_for
from tests.scripts.lease_train import expected
from tests.support.buckets import Bucket
from tests.support.machines import Machine
from tests.support.postgres import PgServer
from tests.support.sweeps import cli, create

pytestmark = pytest.mark.timeout(240)

PROGRAM = str(SCRIPTS / "lease_train.py")


def write_spec(tmp_path: Path, params: dict[str, object], **extra: object) -> Path:
    spec = {
        "program": PROGRAM,
        "method": "grid",
        "metric": {"name": "x", "goal": "minimize"},
        "parameters": params,
        **extra,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def agent(spawn: Callable[..., Child], tmp_path: Path, db: str, sweep: str, *extra: str) -> Child:
    return spawn(
        cli("agent", sweep, "--db", db, "--heartbeat", "0.5", "--lease", "4", *extra),
        cwd=tmp_path,
    )


def states(db: str, sweep: str) -> dict[int, str]:
    with open_store(db) as store:
        return {r.index: r.state for r in store.runs(sweep)}


def final_x(tmp_path: Path, run_id: str) -> int:
    """The value a run ended with (lease_train.py's final.json)."""
    path = tmp_path / ".preemptible" / "runs" / run_id / "final.json"
    return int(json.loads(path.read_text())["x"])


def test_a_stopped_agent_hands_its_run_back_and_another_agent_resumes_it_exactly(
    tmp_path: Path, spawn: Callable[..., Child], store_url: str
) -> None:
    """SIGTERM to agent A mid-run: the run saves, A records PREEMPTED and exits 143 without
    claiming again; agent B takes the run back from the queue (same id, same checkpoints),
    resumes it, and it ends with the value of a run never stopped."""
    spec = write_spec(
        tmp_path,
        {"lr": {"values": [0.05]}, "steps": {"value": 40}, "step-sleep": {"value": 0.05}},
    )
    sweep = create(spawn, tmp_path, store_url, spec)
    a = agent(spawn, tmp_path, store_url, sweep)
    a.wait_line(lambda line: line == "step 10", timeout=120)
    a.signal(signal.SIGTERM)
    assert a.wait(60) == 143, a.output
    assert "no more runs claimed" in a.output
    assert states(store_url, sweep) == {0: "PENDING"}

    b = agent(spawn, tmp_path, store_url, sweep)
    assert b.wait(120) == 0, b.output
    with open_store(store_url) as store:
        [run] = store.runs(sweep)
        attempts = store.attempts(run.id)
    assert run.state == "FINISHED" and run.preemptions == 1
    assert [x.ending for x in attempts] == ["PREEMPTED", "FINISHED"]
    assert attempts[0].checkpoint_step is not None and attempts[0].checkpoint_step >= 10
    assert run.summary is not None and run.summary["step"] == 39
    assert "resuming from" in b.output
    assert final_x(tmp_path, run.id) == expected(40)


def test_a_lost_agent_s_run_is_requeued_once_and_finished_by_another(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    """SIGKILL to an agent and its run's process group (the machine is gone): when the lease
    runs out, another agent requeues the run (CRASHED, a preemption) and finishes it."""
    db = f"sqlite://{tmp_path}/q.db"
    spec = write_spec(tmp_path, {"steps": {"value": 40}, "step-sleep": {"value": 0.05}})
    sweep = create(spawn, tmp_path, db, spec)
    a = agent(spawn, tmp_path, db, sweep)
    a.wait_line(lambda line: line == "step 5", timeout=120)
    with open_store(db) as store:
        [run] = store.runs(sweep)
    pid_of_run = int(
        json.loads((tmp_path / ".preemptible/runs" / run.id / "heartbeat.json").read_text())[
            "child_pid"
        ]
    )
    a.signal_group(signal.SIGKILL)  # the agent
    with contextlib.suppress(ProcessLookupError):  # and the run's group, if its guardian
        os.killpg(pid_of_run, signal.SIGKILL)  # has not ended it already
    b = agent(spawn, tmp_path, db, sweep)
    assert b.wait(120) == 0, b.output
    with open_store(db) as store:
        [run] = store.runs(sweep)
        attempts = store.attempts(run.id)
    assert run.state == "FINISHED" and run.preemptions == 1
    assert [x.ending for x in attempts] == ["CRASHED", "FINISHED"]


def test_cancel_stops_the_running_run_with_a_checkpoint_and_the_agent_exits(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    db = f"sqlite://{tmp_path}/q.db"
    spec = write_spec(
        tmp_path,
        {"lr": {"values": [0.01, 0.02]}, "steps": {"value": 400}, "step-sleep": {"value": 0.05}},
    )
    sweep = create(spawn, tmp_path, db, spec)
    a = agent(spawn, tmp_path, db, sweep)
    a.wait_line(lambda line: line == "step 5", timeout=120)
    cancel = spawn(cli("sweep", "cancel", sweep, "--db", db), cwd=tmp_path)
    assert cancel.wait(60) == 0, cancel.output
    assert a.wait(60) == 0, a.output
    with open_store(db) as store:
        runs = store.runs(sweep)
        attempts = store.attempts(runs[0].id)
    assert [r.state for r in runs] == ["CANCELLED", "CANCELLED"]  # running and pending
    assert len(attempts) == 1 and attempts[0].checkpoint_step is not None  # it saved
    assert sorted((tmp_path / ".preemptible/runs" / runs[0].id / "checkpoints").glob("step-*"))


def test_pause_holds_the_agent_and_resume_lets_it_go_on(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    db = f"sqlite://{tmp_path}/q.db"
    spec = write_spec(tmp_path, {"lr": {"values": [0.01, 0.02]}, "steps": {"value": 3}})
    sweep = create(spawn, tmp_path, db, spec)
    pause = spawn(cli("sweep", "pause", sweep, "--db", db), cwd=tmp_path)
    assert pause.wait(60) == 0, pause.output
    a = agent(spawn, tmp_path, db, sweep)
    wait_for(lambda: "agent" in a.output, 60, "the agent to start")
    with pytest.raises(AssertionError):
        a.wait_line(lambda line: line.startswith("step "), timeout=3)  # nothing runs
    assert states(db, sweep) == {0: "PENDING", 1: "PENDING"}
    resume = spawn(cli("sweep", "resume", sweep, "--db", db), cwd=tmp_path)
    assert resume.wait(60) == 0, resume.output
    assert a.wait(120) == 0, a.output
    assert states(db, sweep) == {0: "FINISHED", 1: "FINISHED"}

    picture = tmp_path / "timeline.png"
    status = spawn(cli("status", sweep, "--db", db, "--json", "--plot", str(picture)))
    assert status.wait(60) == 0, status.output
    doc = json.loads(status.output[status.output.index("{") :])
    assert [r["state"] for r in doc["runs"]] == ["FINISHED", "FINISHED"]
    assert doc["sweep"]["best"]["run_id"] in {r["run_id"] for r in doc["runs"]}
    assert picture.read_bytes().startswith(b"\x89PNG")
    table = spawn(cli("status", sweep, "--db", db))
    assert table.wait(60) == 0, table.output
    assert "lr=0.01 steps=3" in table.output and "FINISHED" in table.output


def test_a_failing_run_uses_its_failure_budget_then_the_agent_moves_on(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    db = f"sqlite://{tmp_path}/q.db"
    spec = write_spec(
        tmp_path,
        {"fail": {"values": [True]}, "steps": {"value": 3}},
        max_failures=1,
        command=["${env}", "${interpreter}", "${program}", "${args_no_boolean_flags}"],
    )
    sweep = create(spawn, tmp_path, db, spec)
    a = agent(spawn, tmp_path, db, sweep)
    assert a.wait(120) == 0, a.output
    with open_store(db) as store:
        [run] = store.runs(sweep)
        attempts = store.attempts(run.id)
    assert run.state == "FAILED" and [x.exit_code for x in attempts] == [3, 3]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["agent", "nosuchid", "--db", "sqlite:///{tmp}/q.db"], "no sweep database at"),
        (["agent", "x", "--db", "mysql://u:secret@h/db"], "***"),
        (["agent", "x", "--heartbeat", "10", "--lease", "5"], "--lease 5 is not valid"),
        (["sweep", "create", "{tmp}/missing.yaml"], "missing.yaml"),
        (["sweep", "create", "{tmp}/bad.yaml"], "parameters.lr.distribution: 'lognormal'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, spawn: Callable[..., Child], args: list[str], says: str
) -> None:
    (tmp_path / "bad.yaml").write_text(
        "program: train.py\nmethod: random\n"
        "parameters:\n  lr: {distribution: lognormal, mu: 0, sigma: 1}\n"
    )
    child = spawn(cli(*(a.format(tmp=tmp_path) for a in args)), cwd=tmp_path)
    assert child.wait(60) == 2, child.output
    errors = [line for line in child.lines if line.startswith("preemptible:")]
    assert len(errors) == 1 and says in errors[0], child.output
    assert "Traceback" not in child.output and "secret" not in child.output


def test_cancel_now_kills_the_run_at_once(tmp_path: Path, spawn: Callable[..., Child]) -> None:
    db = f"sqlite://{tmp_path}/q.db"
    spec = write_spec(tmp_path, {"steps": {"value": 4000}, "step-sleep": {"value": 0.05}})
    sweep = create(spawn, tmp_path, db, spec)
    a = agent(spawn, tmp_path, db, sweep)
    a.wait_line(lambda line: line == "step 5", timeout=120)
    cancel = spawn(cli("sweep", "cancel", sweep, "--now", "--db", db), cwd=tmp_path)
    assert cancel.wait(60) == 0, cancel.output
    assert a.wait(60) == 0, a.output
    with open_store(db) as store:
        [run] = store.runs(sweep)
        [attempt] = store.attempts(run.id)
    assert run.state == "CANCELLED"
    assert attempt.exit_code == 128 + signal.SIGKILL and attempt.checkpoint_step is None


def test_stop_lets_the_running_run_finish_and_claims_nothing_more(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    db = f"sqlite://{tmp_path}/q.db"
    spec = write_spec(
        tmp_path,
        # ~6 s of run 0 left after step 3: time for a loaded machine to start `sweep stop`
        {"lr": {"values": [0.01, 0.02]}, "steps": {"value": 120}, "step-sleep": {"value": 0.05}},
    )
    sweep = create(spawn, tmp_path, db, spec)
    a = agent(spawn, tmp_path, db, sweep)
    a.wait_line(lambda line: line == "step 3", timeout=120)
    stop = spawn(cli("sweep", "stop", sweep, "--db", db), cwd=tmp_path)
    assert stop.wait(60) == 0, stop.output
    assert a.wait(60) == 0, a.output
    assert states(db, sweep) == {0: "FINISHED", 1: "PENDING"}


def readonly(home: Path) -> list[str]:
    """A prefix under which ``home`` is read-only, for root too (a private bind mount)."""
    home.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        home.chmod(0o555)
        return []
    import shutil
    import subprocess

    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-m", "true"], capture_output=True).returncode:
        pytest.skip("a read-only home for root needs unshare(1) and a mount namespace")
    script = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"'
    return [unshare, "-m", "sh", "-c", script, str(home)]


@pytest.mark.parametrize("cause", ["no such program", "unset ${envvar:X}", "read-only --home"])
def test_runs_that_cannot_start_are_said_once_and_the_agent_stops_before_burning_the_queue(
    tmp_path: Path, spawn: Callable[..., Child], cause: str
) -> None:
    """The issue's reproductions (51 and 1,681 runs FAILED in seconds, a whole grid in 1 ms):
    the reason is said once, every run goes back untouched (no attempt, no failure counted),
    the agent backs off and exits 2 after --max-consecutive-failures runs in a row, and no
    run directory is made for a run that could not start."""
    db = f"sqlite://{tmp_path}/q.db"
    home = tmp_path / "home"
    command = {
        "no such program": [str(tmp_path / "no-such-program")],
        "unset ${envvar:X}": [
            "${env}",
            "${interpreter}",
            "${program}",
            "${envvar:PREEMPTIBLE_NO_SUCH_VAR}",
        ],
        "read-only --home": ["${env}", "${interpreter}", "${program}", "${args}"],
    }[cause]
    spec = write_spec(
        tmp_path, {"lr": {"values": [i / 100 for i in range(1, 41)]}}, command=command
    )
    sweep = create(spawn, tmp_path, db, spec)
    prefix = readonly(home) if cause == "read-only --home" else []
    env = {k: v for k, v in os.environ.items() if k != "PREEMPTIBLE_NO_SUCH_VAR"}
    a = spawn(
        [
            *prefix,
            *cli(
                "agent",
                sweep,
                "--db",
                db,
                "--home",
                str(home),
                "--heartbeat",
                "0.5",
                "--lease",
                "4",
                "--max-consecutive-failures",
                "3",
            ),
        ],
        cwd=tmp_path,
        env=env,
    )
    assert a.wait(60) == 2, a.output
    said = [line for line in a.lines if "could not start" in line]
    assert len(said) == 2, a.output  # the reason once, and the agent's last line
    assert "agent stops: the last 3 runs could not start" in said[-1]
    assert "nothing counted against them" in said[-1]
    with open_store(db) as store:
        runs = store.runs(sweep)
        assert {(r.state, r.attempt, r.failures) for r in runs} == {("PENDING", 0, 0)}
        assert len(runs) == 40 and all(store.attempts(r.id) == [] for r in runs)
    made = sorted(p.name for p in (home / "runs").iterdir()) if (home / "runs").exists() else []
    assert made == ([f"{sweep}-0"] if cause == "no such program" else []), made
    if made:
        assert not list((home / "runs" / made[0]).glob("attempt-*"))


def test_runs_that_fail_within_seconds_stop_the_agent_after_a_few(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    """A program that fails at once (a typo in the training script): each run that ran is
    recorded FAILED on its own budget, the agent backs off between them and stops with one
    line (exit 1) after --max-consecutive-failures, instead of failing the whole queue."""
    db = f"sqlite://{tmp_path}/q.db"
    spec = write_spec(
        tmp_path, {"lr": {"values": [i / 100 for i in range(1, 21)]}}, command=["/bin/false"]
    )
    sweep = create(spawn, tmp_path, db, spec)
    a = agent(spawn, tmp_path, db, sweep, "--max-consecutive-failures", "3")
    assert a.wait(60) == 1, a.output
    last = [line for line in a.lines if "agent stops" in line]
    assert len(last) == 1 and "the last 3 runs failed within 10 s each" in last[0], a.output
    assert Counter(states(db, sweep).values()) == {"FAILED": 3, "PENDING": 17}


def test_a_run_id_planted_in_the_database_is_refused_before_anything_is_made(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    """A run id such as ../../../outside/X names a directory outside --home: the agent checks
    it before it makes a directory or writes params.json, and the run FAILS on its own budget."""
    import sqlite3

    db = f"sqlite://{tmp_path}/q.db"
    spec = write_spec(
        tmp_path,
        {"lr": {"values": [0.1]}},
        command=["${env}", "${interpreter}", "${program}", "--cfg=${args_json_file}"],
    )
    sweep = create(spawn, tmp_path, db, spec)
    bad = "../../../outside/X"
    with contextlib.closing(sqlite3.connect(tmp_path / "q.db")) as conn, conn:
        conn.execute(
            "UPDATE preemptible_runs SET id = ?, checkpoint_dir = ? WHERE sweep_id = ?",
            (bad, bad, sweep),
        )
    home = tmp_path / "deep" / "down" / "home"
    a = agent(spawn, tmp_path, db, sweep, "--home", str(home))
    assert a.wait(60) == 0, a.output
    assert f"run id {bad!r} (from the sweep database) is not valid" in a.output
    assert not (home / "runs" / bad).resolve().parent.exists()
    assert not (home / "runs").exists()
    with open_store(db) as store:
        [run] = store.runs(sweep)
    assert (run.id, run.state) == (bad, "FAILED")


def test_agents_that_share_no_disk_hand_a_preempted_run_over_through_a_bucket(
    tmp_path: Path,
    spawn: Callable[..., Child],
    s3_bucket: Bucket,
    pg_server: PgServer,
    pg_database: str,
) -> None:
    """Two agents on two "machines" (each its own working directory, --home, HOME with the
    staging directory, and TMPDIR), one queue (PostgreSQL, as agents on several machines use),
    checkpoints under ``--checkpoint-dir URL``.
    SIGTERM to agent A mid-run: the run saves, uploads and goes back to the queue; A's machine
    is gone; agent B takes the run, resumes it from the bucket, and it ends with the value of a
    run never stopped."""
    spec = write_spec(
        tmp_path,
        {"lr": {"values": [0.05]}, "steps": {"value": 40}, "step-sleep": {"value": 0.05}},
    )
    db = pg_server.database_url(pg_database)
    sweep = create(spawn, tmp_path, db, spec)
    url = f"{s3_bucket.url}/sweep"
    one, two = Machine(tmp_path / "one"), Machine(tmp_path / "two")

    def agent_on(machine: Machine) -> Child:
        args = ("--heartbeat", "0.5", "--lease", "4", "--checkpoint-dir", url)
        return spawn(cli("agent", sweep, "--db", db, *args), cwd=machine.cwd, env=machine.env)

    a = agent_on(one)
    a.wait_line(lambda line: line == "step 10", timeout=120)
    a.signal(signal.SIGTERM)
    assert a.wait(60) == 143, a.output
    assert states(db, sweep) == {0: "PENDING"}
    one.gone()

    b = agent_on(two)
    assert b.wait(120) == 0, b.output
    with open_store(db) as store:
        [run] = store.runs(sweep)
        attempts = store.attempts(run.id)
    assert run.state == "FINISHED" and run.preemptions == 1
    assert [x.ending for x in attempts] == ["PREEMPTED", "FINISHED"]
    assert attempts[0].checkpoint_step is not None and attempts[0].checkpoint_step >= 10
    steps = [int(line.split()[1]) for line in b.lines if line.startswith("step ")]
    assert steps[0] > 10 and steps[-1] == 39, b.output
    final = two.cwd / ".preemptible" / "runs" / run.id / "final.json"
    assert int(json.loads(final.read_text())["x"]) == expected(40)
