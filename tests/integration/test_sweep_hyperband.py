"""A real sweep with Hyperband early termination: one ``preemptible agent`` process runs a grid
of ``tests/scripts/hyperband_train.py`` (no torch) whose loss is worse the larger its
``quality``; the losing runs are stopped gracefully (a committed checkpoint, state STOPPED),
the winners finish; ``sweep resume --run`` puts one stopped run back and a second agent
continues it from its checkpoint to the state of a run never stopped, bit for bit."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from preemptible.checkpoint._store import CheckpointStore
from preemptible.sweeps.store._queue import open_store
from tests.conftest import SCRIPTS, Child
from tests.scripts.hyperband_train import uninterrupted
from tests.support.sweeps import cli, create

pytestmark = pytest.mark.timeout(240)

STEPS = 30


def test_losing_runs_are_stopped_with_a_checkpoint_and_one_resumes_exactly(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    db = f"sqlite://{tmp_path}/q.db"
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        json.dumps(
            {
                "program": str(SCRIPTS / "hyperband_train.py"),
                "method": "grid",
                "metric": {"name": "loss", "goal": "minimize"},
                "parameters": {
                    "quality": {"values": [1, 2, 3, 4]},
                    "steps": {"value": STEPS},
                    "step-sleep": {"value": 0.1},
                },
                # bands at 3, 6, 12, 24 points; the best 1/2 go on at each
                "early_terminate": {"type": "hyperband", "min_iter": 3, "eta": 2},
            }
        )
    )
    sweep = create(spawn, tmp_path, db, spec)
    agent_args = ("--db", db, "--heartbeat", "0.2", "--lease", "4")
    first = spawn(cli("agent", sweep, *agent_args), cwd=tmp_path)
    assert first.wait(180) == 0, first.output

    # One agent runs the grid in order: quality 1 sets the bar, 2 ties the threshold at each
    # band (the one at int(n / 2) of n sorted values) and goes on; 3 and 4 are worse at band 3.
    with open_store(db) as store:
        runs = store.runs(sweep)
        attempts = {r.id: store.attempts(r.id) for r in runs}
    states = {int(r.params["quality"]): r.state for r in runs}
    assert states == {1: "FINISHED", 2: "FINISHED", 3: "STOPPED", 4: "STOPPED"}, first.output
    assert first.output.count("early termination (hyperband) stops it") == 2
    home = tmp_path / ".preemptible" / "runs"
    stopped = [r for r in runs if r.state == "STOPPED"]
    for run in stopped:
        [attempt] = attempts[run.id]
        assert (attempt.ending, run.preemptions, run.failures) == ("STOPPED", 0, 0)
        newest = CheckpointStore(home / run.id / "checkpoints", create=False).latest()
        assert newest is not None and newest.step == attempt.checkpoint_step
        assert 3 <= newest.step < STEPS  # stopped at band 3 or soon after, not at the end
        assert not (home / run.id / "final.json").exists()
    for run in runs:
        if run.state == "FINISHED":
            assert [a.ending for a in attempts[run.id]] == ["FINISHED"]
    # the local view (from the run directories, no queue) says the same
    local = spawn(cli("runs", "--home", str(home.parent), "--json"), cwd=tmp_path)
    assert local.wait(60) == 0, local.output
    shown = {row["run_id"]: row["state"] for row in json.loads(local.output)}
    assert shown == {r.id: r.state for r in runs}, local.output

    chosen = stopped[0]
    resume = spawn(cli("sweep", "resume", sweep, "--run", chosen.id, "--db", db), cwd=tmp_path)
    assert resume.wait(60) == 0, resume.output
    again = spawn(cli("agent", sweep, *agent_args), cwd=tmp_path)
    assert again.wait(120) == 0, again.output
    assert "early termination" not in again.output  # resumed by hand: exempt
    with open_store(db) as store:
        run = store.run(chosen.id)
        ends = [a.ending for a in store.attempts(chosen.id)]
        others = {r.id: r.state for r in store.runs(sweep) if r.id != chosen.id}
    assert (run.state, ends, run.early_exempt) == ("FINISHED", ["STOPPED", "FINISHED"], True)
    assert others == {r.id: r.state for r in runs if r.id != chosen.id}  # nothing else ran
    final = json.loads((home / chosen.id / "final.json").read_text())
    quality = int(chosen.params["quality"])
    assert final == uninterrupted(quality, STEPS, seed=0)  # bit for bit: floats and RNG state
