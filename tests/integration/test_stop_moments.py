"""A stop is a stop wherever it lands: before the program's handler exists (its start-up), in
its loop, and after its loop (its handler closed, the program writing its results). Real
supervisors and agents, real signals, a real SQLite queue; ``tests/scripts/moments.py`` holds
still at the chosen moment of its first attempt, so that each signal lands where it is meant
to. Each attempt stopped so is PREEMPTED (the supervisor passed the stop on); the next one
resumes from the newest checkpoint, trains no step it had committed (the plain handler commits
the last step as its loop ends), and ends FINISHED with the value of a run never stopped."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from preemptible.sweeps.store._queue import open_store
from tests.conftest import PY, SCRIPTS, Child, attempts, python_args, supervise
from tests.scripts.lease_train import expected
from tests.support.slurm import FakeScontrol
from tests.support.sweeps import cli, create

pytestmark = pytest.mark.timeout(120)

STEPS = 5
# the steps the next attempt trains, after a stop at each moment of the first
RETRAINED = {"start": list(range(STEPS)), "loop": [3, 4], "save": list(range(STEPS)), "end": []}


def trained(lines: list[str]) -> list[int]:
    return [int(line.split()[1]) for line in lines if line.startswith("step ")]


@pytest.mark.parametrize(
    ("moment", "sig"),
    [
        ("start", signal.SIGTERM),
        ("loop", signal.SIGINT),
        ("save", signal.SIGTERM),
        ("end", signal.SIGTERM),
    ],
)
def test_preemptible_run_stopped_at_any_moment_is_preempted_and_its_rerun_finishes(
    tmp_path: Path, spawn: Callable[..., Child], moment: str, sig: int
) -> None:
    """The issue's ``preemptible run`` cases: stopped during its start-up (before the handler
    exists) it exits 128 + signum and records PREEMPTED, not CRASHED; stopped after its loop
    (the handler closed) too, and its last step is committed, so the rerun trains nothing; a
    stop whose save hangs past ``--term-timeout`` is the supervisor's own SIGKILL: PREEMPTED."""
    job = python_args("moments.py", "--at", moment, "--steps", str(STEPS))
    sup = supervise(spawn, tmp_path, "--term-timeout", "1", "--", *job)
    held = "loop" if moment == "save" else moment  # the stop's save hangs after the loop's
    sup.wait_line(lambda line: line.endswith(f"waiting at {held}"), timeout=60)
    sup.signal(sig)
    if moment == "save":
        sup.wait_line(lambda line: line.endswith("waiting at save"), timeout=60)
    assert sup.wait(60) == 128 + sig, sup.output
    [a] = attempts(tmp_path)
    assert (a["state"], a["exit_code"]) == ("PREEMPTED", 128 + sig), a
    assert a.get("killed", False) is (moment == "save"), a

    again = supervise(spawn, tmp_path, "--term-timeout", "1", "--", *job)
    assert again.wait(60) == 0, again.output
    first, second = attempts(tmp_path)
    assert (first["state"], second["state"]) == ("PREEMPTED", "FINISHED")
    assert trained(again.lines) == RETRAINED[moment], again.output
    assert f"trained {expected(STEPS)}" in again.lines, again.output


def test_a_usr1_at_start_up_under_slurm_requeues_the_job(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    """``sbatch --signal=USR1``'s warning during the program's start-up: the attempt is
    PREEMPTED, so the supervisor requeues the job (a fake ``scontrol`` records the call)."""
    fake = FakeScontrol(tmp_path / "bin")
    fake.answer()
    env = {**fake.env(), "SLURM_JOB_ID": "12"}
    job = python_args("moments.py", "--at", "start")
    sup = supervise(spawn, tmp_path, "--", *job, env=env)
    sup.wait_line(lambda line: line.endswith("waiting at start"), timeout=60)
    sup.signal(signal.SIGUSR1)
    assert sup.wait(60) == 138, sup.output
    [a] = attempts(tmp_path)
    assert (a["state"], a["ending"]) == ("PREEMPTED", "killed by SIGUSR1"), a
    assert "requeue 12" in fake.calls, fake.calls
    assert "requeued SLURM job 12" in sup.output, sup.output


SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


@pytest.mark.parametrize("moment", ["start", "loop", "end"])
def test_an_agent_stopped_at_any_moment_hands_its_run_back_and_another_finishes_it(
    tmp_path: Path, spawn: Callable[..., Child], moment: str
) -> None:
    """Three agents, each holding one run still at ``moment``, stopped by SIGTERM, SIGINT and
    SIGUSR1: each exits 128 + signum, and its run goes back to the queue (PREEMPTED, PENDING
    again, no failure spent under ``max_failures: 0``); one more agent finishes all three."""
    db = f"sqlite://{tmp_path}/q.db"
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"program: {SCRIPTS / 'moments.py'}\nmethod: grid\n"
        f"parameters:\n  at: {{value: {moment}}}\n  steps: {{value: {STEPS}}}\n"
        "  tag: {values: [a, b, c]}\n"
    )
    sweep = create(spawn, tmp_path, db, spec)

    def agent() -> Child:
        args = cli("agent", sweep, "--db", db, "--heartbeat", "0.5", "--lease", "4")
        return spawn(args, cwd=tmp_path)

    agents = [agent() for _ in SIGNALS]
    for a in agents:  # all three hold a run before any is stopped: none takes another's
        a.wait_line(lambda line: line.endswith(f"waiting at {moment}"), timeout=60)
    for a, sig in zip(agents, SIGNALS, strict=True):
        a.signal(sig)
    for a, sig in zip(agents, SIGNALS, strict=True):
        assert a.wait(60) == 128 + sig, a.output
        assert "no more runs claimed" in a.output
    with open_store(db) as store:
        runs = store.runs(sweep)
        assert [(r.state, r.failures, r.preemptions) for r in runs] == [("PENDING", 0, 1)] * 3
        firsts = [store.attempts(r.id) for r in runs]
    assert sorted(x.exit_code for [x] in firsts) == sorted(128 + s for s in SIGNALS), firsts
    assert {x.ending for [x] in firsts} == {"PREEMPTED"}

    last = agent()
    assert last.wait(60) == 0, last.output
    with open_store(db) as store:
        runs = store.runs(sweep)
        assert {r.state for r in runs} == {"FINISHED"}
        assert all(
            [x.ending for x in store.attempts(r.id)] == ["PREEMPTED", "FINISHED"] for r in runs
        )
    assert trained(last.lines) == RETRAINED[moment] * 3, last.output
    assert [line for line in last.lines if line.startswith("trained")] == [
        f"trained {expected(STEPS)}"
    ] * 3, last.output


STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(120)"
)


def test_a_stop_while_the_agent_prepares_the_attempt_is_that_attempt_s(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    """The agent has claimed the run and its supervisor is stopping what an earlier attempt
    left running (a process that ignores SIGTERM): a SIGTERM to the agent then is passed on to
    the attempt as it starts and counts as its stop, so the run goes back to the queue as
    PREEMPTED (it was CRASHED, final under ``max_failures: 0``); another agent finishes it."""
    db = f"sqlite://{tmp_path}/q.db"
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"program: {SCRIPTS / 'moments.py'}\nmethod: grid\nparameters:\n  at: {{value: start}}\n"
    )
    sweep = create(spawn, tmp_path, db, spec)
    run_dir = (tmp_path / ".preemptible" / "runs" / f"{sweep}-0").resolve()
    left = spawn([PY, "-c", STUBBORN], env={"PREEMPTIBLE_RUN_DIR": f"{run_dir}/attempt-0"})
    left.wait_line(lambda line: line == "up", timeout=60)
    agent = cli("agent", sweep, "--db", db, "--heartbeat", "0.5", "--lease", "4")
    a = spawn(agent, cwd=tmp_path)
    a.wait_line(lambda line: "of an earlier attempt of run" in line, timeout=60)
    a.signal(signal.SIGTERM)
    assert a.wait(60) == 143, a.output
    assert left.wait(30) == -signal.SIGKILL  # stopped at once: the agent was told to stop
    with open_store(db) as store:
        [run] = store.runs(sweep)
        [first] = store.attempts(run.id)
    assert (run.state, run.failures, first.ending) == ("PENDING", 0, "PREEMPTED"), a.output
    b = spawn(agent, cwd=tmp_path)
    assert b.wait(60) == 0, b.output
    assert states_of(db, sweep) == ["FINISHED"]


def states_of(db: str, sweep: str) -> list[str]:
    with open_store(db) as store:
        return [r.state for r in store.runs(sweep)]
