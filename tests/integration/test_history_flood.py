"""The metric flood (issue 31, item 4): a run that reports 500 metrics a step as fast as it can,
under an agent with a short heartbeat and lease. Copying its history must not starve the
lease's renewals (the agent stopped its own run for a lease it held), and the attempt is
recorded soon after it ends, with every point it reported stored once."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from preemptible._report import read_history
from preemptible.sweeps.store._queue import open_store
from tests.conftest import SCRIPTS, Child
from tests.support.sweeps import cli, create

pytestmark = pytest.mark.timeout(120)

STEPS, METRICS = 1000, 500


def test_a_metric_flood_neither_starves_the_lease_nor_delays_the_record(
    spawn: Callable[..., Child], tmp_path: Path, store_url: str
) -> None:
    doc = {
        "program": str(SCRIPTS / "flood_train.py"),
        "method": "grid",
        "parameters": {
            "steps": {"value": STEPS},
            "metrics": {"value": METRICS},
            "hold": {"value": 6.0},
        },
        "max_failures": 0,
    }
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps(doc))
    sweep = create(spawn, tmp_path, store_url, spec)
    args = ["agent", sweep, "--db", store_url, "--heartbeat", "0.5", "--lease", "3", "--count", "1"]
    agent = spawn(cli(*args), cwd=tmp_path)
    assert agent.wait(90) == 0, agent.output
    assert "has not been renewed" not in agent.output  # never stopped for its own lease
    with open_store(store_url, create=False) as store:
        (run,) = store.runs(sweep)
        attempts = store.attempts(run.id)
        history = store.run_history(run.id)
    assert run.state == "FINISHED" and [a.ending for a in attempts] == ["FINISHED"], agent.output
    attempt_dir = tmp_path / ".preemptible" / "runs" / run.id / "attempt-1"
    assert count_points(attempt_dir / "history.jsonl") == STEPS * METRICS
    assert len(history) == METRICS
    assert sum(len(points) for points in history.values()) == STEPS * METRICS
    assert history["metric_007"][-1] == (STEPS - 1, STEPS - 1 + 0.007, 1)
    ended = json.loads((attempt_dir / "ended.json").read_text())["at"]
    assert attempts[0].ended_at is not None
    to_record = attempts[0].ended_at - ended
    # quiet, the copy has caught up during the 6 s hold and this is under a second; with CI's
    # three lanes on two cores the copy runs at a fraction of its rate (3.7 s seen, 17.9 s once
    # with four more test processes on the two cores): the bound says "soon", against the
    # minutes a final copy with no renewals took before
    assert to_record < 30.0, f"recorded {to_record:.1f} s after the end\n{agent.output}"


def count_points(path: Path) -> int:
    total = offset = 0
    while True:
        points, moved = read_history(path, offset)
        if moved == offset:
            return total
        total, offset = total + len(points), moved
