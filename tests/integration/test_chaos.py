"""The chaos run's short form (``benchmarks/bench_chaos.py``): agents SIGKILLed and SIGSTOPped,
runs and guardians SIGKILLed at random, the database restarted (PostgreSQL); every run must
end FINISHED with the value of a run never stopped, none run twice at once or again after it
finished, none that was not hurt counted as a failure, and no trainer left behind.
PREEMPTIBLE_STRESS_SCALE sizes it (1: 2 agents, 4 runs; 10: 4 agents, 40 runs)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.support.postgres import pg_binaries

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_chaos import chaos

SCALE = float(os.environ.get("PREEMPTIBLE_STRESS_SCALE", "1"))


@pytest.mark.slow
@pytest.mark.timeout(int(600 * max(SCALE, 1)))
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_chaos_loses_nothing_doubles_nothing_and_fails_no_healthy_run(
    tmp_path: Path, backend: str
) -> None:
    if backend == "postgres" and not pg_binaries():
        pytest.skip("no PostgreSQL server binaries (pg_ctl): install postgresql to run this")
    result = chaos(
        backend,
        agents=2 if SCALE < 5 else 4,
        runs=max(4, round(4 * SCALE)),
        steps=20,
        step_sleep=0.05,
        seed=7,
        deadline=240 * max(SCALE, 1),
        work=tmp_path,
        actions=round(8 * SCALE),
    )
    summary = result.as_json()
    assert sum(result.actions.values()) >= 5, summary  # there was chaos, each kind once
    assert (result.lost, result.doubled, result.healthy_failed, result.wrong) == (
        [],
        [],
        [],
        [],
    ), summary
    assert result.orphans == 0, summary
