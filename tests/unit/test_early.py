"""Early termination in the agent (``sweeps/_early``): the judge on given histories, what a
stopped attempt ends as, and the STOPPED state on a real SQLite queue (settle, ``sweep resume
--run``, the migration that added it)."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from preemptible import ConfigError
from preemptible._states import Ending, QueueState
from preemptible.cli._main import main
from preemptible.sweeps.agent._early import Judge, Stop, early_ending, judge, judge_for
from preemptible.sweeps.spec._hyperband import parse_early_terminate, stop_decisions
from preemptible.sweeps.spec._spec import parse_spec
from preemptible.sweeps.status._render import _header_line
from preemptible.sweeps.status._snapshot import snapshot
from preemptible.sweeps.store import _schema
from preemptible.sweeps.store._queue import Store, open_store

pytestmark = pytest.mark.timeout(60)

SPEC: dict[str, Any] = {
    "program": "train.py",
    "method": "grid",
    "metric": {"name": "loss", "goal": "minimize"},
    "parameters": {"lr": {"values": [1, 2, 3, 4]}},
    "early_terminate": {"type": "hyperband", "min_iter": 2, "eta": 2},
}


def points(*values: float) -> list[tuple[int, float]]:
    return [(step, v) for step, v in enumerate(values, start=1)]


# -- the judge ----------------------------------------------------------------------------
def test_the_worse_half_is_stopped_at_the_band_it_reached_with_the_bands_threshold() -> None:
    config = parse_early_terminate(SPEC["early_terminate"])  # bands 2, 4, 8, ...
    histories = {
        "a": points(1.0, 0.5, 0.4),
        "b": points(1.0, 0.6),
        "c": points(1.0, 0.9, 0.8),
        "d": points(1.0, 0.95),
    }
    # at band 2 the values are 0.5 0.6 0.9 0.95: the threshold is the one at int(4 / 2) = 2,
    # 0.9; only what is worse is stopped, so "c" (a tie) goes on and "d" is stopped
    for run, stopped in (("a", False), ("b", False), ("c", False), ("d", True)):
        verdict = judge(config, goal="minimize", histories=histories, run_id=run)
        assert (verdict is not None) == stopped, run
        values = {r: [v for _, v in p] for r, p in histories.items()}
        assert stop_decisions(config, goal="minimize", histories=values, running={run}) == (
            {run} if stopped else set()
        )
    verdict = judge(config, goal="minimize", histories=histories, run_id="d")
    assert verdict == Stop("d", band=2, value=0.95, threshold=0.9, step=2)
    assert "band 2" in verdict.describe("loss") and "0.9" in verdict.describe("loss")


def test_before_the_first_band_and_without_points_a_run_is_never_stopped() -> None:
    config = parse_early_terminate({"type": "hyperband", "min_iter": 3})
    histories = {"a": points(0.1, 0.1, 0.1), "b": points(0.1, 0.1, 0.1), "late": points(9.0)}
    assert judge(config, goal="minimize", histories=histories, run_id="late") is None
    store = _Histories(histories)
    spec = parse_spec({**SPEC, "early_terminate": {"type": "hyperband", "min_iter": 3}})
    assert Judge(spec, "s", "absent").check(store) is None
    assert Judge(spec, "s", "late").check(store) is None
    assert store.asked == [("absent", "loss"), ("late", "loss")]  # no band reached: no more


def test_maximize_and_non_strict_judge_by_the_goal_and_the_best_value() -> None:
    strict = parse_early_terminate({"type": "hyperband", "min_iter": 2, "eta": 2})
    lenient = parse_early_terminate({"type": "hyperband", "min_iter": 2, "eta": 2, "strict": False})
    histories = {
        "a": points(0.9, 0.9),
        "b": points(0.8, 0.8),
        "once_good": points(0.95, 0.1),
        "d": points(0.1, 0.15),
        "e": points(0.3, 0.3),
    }  # at band 2: 0.9 0.8 0.3 0.15 0.1, threshold 0.3 (at int(5 / 2))
    assert judge(strict, goal="maximize", histories=histories, run_id="once_good") is not None
    spared = judge(lenient, goal="maximize", histories=histories, run_id="once_good")
    assert spared is None
    stopped = judge(lenient, goal="maximize", histories=histories, run_id="d")
    assert stopped == Stop("d", band=2, value=0.15, threshold=0.3, step=2)


class _Histories:
    """Counts what the judge reads (the queue's own reads: test_sweep_store)."""

    def __init__(self, found: dict[str, list[tuple[int, float]]]) -> None:
        self.found, self.asked = found, []  # type: ignore[var-annotated]

    def metric_points(self, run_id: str, name: str) -> list[tuple[int, float]]:
        self.asked.append((run_id, name))
        return self.found.get(run_id, [])

    def band_values(self, sweep_id: str, name: str, bands: Any) -> dict[int, list[float]]:
        raise AssertionError("read before the run reached a band")


def test_a_judge_only_for_a_sweep_with_early_terminate_and_a_run_not_resumed_by_hand() -> None:
    spec = parse_spec(SPEC)
    assert isinstance(judge_for(spec, "s", "s-0", exempt=False), Judge)
    assert judge_for(spec, "s", "s-0", exempt=True) is None
    plain = parse_spec({k: v for k, v in SPEC.items() if k != "early_terminate"})
    assert judge_for(plain, "s", "s-0", exempt=False) is None
    assert "early_terminate" not in spec.ignored


def test_a_stopped_attempt_ends_stopped_unless_it_finished_failed_or_lost_its_lease() -> None:
    stop = Stop("r", band=2, value=1.0, threshold=0.5, step=2)
    assert early_ending(Ending.PREEMPTED, stop, expired=False) == Ending.STOPPED
    assert early_ending(Ending.KILLED, stop, expired=False) == Ending.STOPPED
    assert early_ending(Ending.CRASHED, stop, expired=False) == Ending.STOPPED  # no handler
    assert early_ending(Ending.FINISHED, stop, expired=False) == Ending.FINISHED
    assert early_ending(Ending.FAILED, stop, expired=False) == Ending.FAILED
    assert early_ending(Ending.PREEMPTED, stop, expired=True) == Ending.PREEMPTED
    assert early_ending(Ending.PREEMPTED, None, expired=False) == Ending.PREEMPTED


# -- STOPPED in a real SQLite queue -------------------------------------------------------
@pytest.fixture
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'sweeps.db'}"


@pytest.fixture
def store(db: str) -> Iterator[Store]:
    s = open_store(db, retry_timeout=10)
    yield s
    s.close()


def _sweep(store: Store) -> str:
    sweep = store.create_sweep(SPEC, name=None, run_cap=None, max_failures=0, max_preemptions=1)
    store.add_runs(sweep, [{"lr": 1}, {"lr": 2}])
    return sweep


def _stop_one(store: Store, sweep: str) -> str:
    c = store.claim(sweep, agent="a", host="h", lease=60, propose=None)
    assert c is not None
    state = store.finish(
        c.run_id,
        agent="a",
        attempt=c.attempt,
        epoch=c.epoch,
        ending=Ending.STOPPED,
        exit_code=143,
        duration=1.0,
        checkpoint_step=2,
        summary={"loss": 0.9},
    )
    assert state == QueueState.STOPPED
    return c.run_id


def test_a_stopped_run_ends_stopped_spends_nothing_and_resumes_by_hand_exempt(
    store: Store,
) -> None:
    sweep = _sweep(store)
    run_id = _stop_one(store, sweep)
    row = store.run(run_id)
    assert (row.state, row.preemptions, row.failures, row.early_exempt) == (
        QueueState.STOPPED,
        0,
        0,
        False,
    )
    [attempt] = store.attempts(run_id)
    assert (attempt.ending, attempt.outcome, attempt.checkpoint_step) == (
        Ending.STOPPED,
        QueueState.STOPPED,
        2,
    )
    store.resume_stopped(sweep, run_id)
    row = store.run(run_id)
    assert (row.state, row.early_exempt) == (QueueState.PENDING, True)
    again = store.claim(sweep, agent="b", host="h", lease=60, propose=None)
    assert again is not None  # first in line, before the run that never ran
    assert (again.run_id, again.attempt, again.checkpoint_dir) == (run_id, 2, row.checkpoint_dir)
    with pytest.raises(ConfigError, match=r"is RUNNING, not STOPPED"):
        store.resume_stopped(sweep, run_id)
    with pytest.raises(ConfigError, match=r"no run 'nope' in sweep"):
        store.resume_stopped(sweep, "nope")


def test_sweep_resume_run_refuses_bad_input_in_one_line_exit_2(store: Store, db: str) -> None:
    sweep = _sweep(store)
    run_id = _stop_one(store, sweep)
    runner = CliRunner()
    for args, why in (
        (["--run", "nope"], "no run 'nope'"),
        (["--run", f"{sweep}-1"], "is PENDING, not STOPPED"),
    ):
        result = runner.invoke(main, ["sweep", "resume", sweep, *args, "--db", db])
        assert result.exit_code == 2, result.output
        assert why in result.output and len(result.output.strip().splitlines()) == 1
    result = runner.invoke(main, ["sweep", "resume", sweep, "--run", run_id, "--db", db])
    assert result.exit_code == 0, result.output
    assert store.run(run_id).state == QueueState.PENDING


def test_the_migration_keeps_every_run_attempt_index_and_foreign_key(
    db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    everything = _schema.migrations
    monkeypatch.setattr(_schema, "migrations", lambda kind: everything(kind)[:3])
    with open_store(db) as old:
        assert old.schema_versions() == [1, 2, 3]
        sweep = _sweep(old)
        run_id = f"{sweep}-0"
    # an attempt that ran and finished, as version 3 stored it (today's claim and finish use
    # columns of later versions)
    with contextlib.closing(sqlite3.connect(db[len("sqlite:///") :])) as conn, conn:
        conn.execute(
            "UPDATE preemptible_runs SET state = 'FINISHED', attempt = 1, lease_epoch = 1, "
            "summary = '{\"loss\": 0.5}' WHERE id = ?",
            (run_id,),
        )
        conn.execute(
            "INSERT INTO preemptible_attempts (run_id, number, agent, host, started_at, "
            "ended_at, ending, exit_code, duration, checkpoint_step, outcome, closed_by, epoch) "
            "VALUES (?, 1, 'a', 'h', 1, 2, 'FINISHED', 0, 1.0, 3, 'FINISHED', 'a', 1)",
            (run_id,),
        )
        conn.executemany(
            "INSERT INTO preemptible_history (run_id, name, step, value, attempt) "
            "VALUES (?, 'loss', ?, ?, 1)",
            [(run_id, 1, 0.7), (run_id, 2, 0.5)],
        )
    c = run_id
    path = db[len("sqlite:///") :]
    columns = "id, state, summary, lease_epoch, checkpoint_dir, queued_at"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        before = conn.execute(f"SELECT {columns} FROM preemptible_runs ORDER BY id").fetchall()
    assert [r[1] for r in before] == [QueueState.FINISHED, QueueState.PENDING]
    monkeypatch.setattr(_schema, "migrations", everything)
    with open_store(db) as new:
        assert new.schema_versions() == [v for v, _ in everything("sqlite")]
        assert [r.state for r in new.runs(sweep)] == [QueueState.FINISHED, QueueState.PENDING]
        assert [a.checkpoint_step for a in new.attempts(c)] == [3]
        assert not any(r.early_exempt for r in new.runs(sweep))
        assert new.histories(sweep, "loss") == {c: [(1, 0.7), (2, 0.5)]}
    conn = sqlite3.connect(path)
    try:
        after = conn.execute(f"SELECT {columns} FROM preemptible_runs ORDER BY id").fetchall()
        assert after == before
        indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        assert {
            "preemptible_runs_queue",
            "preemptible_runs_lease",
            "preemptible_runs_claim",
            "preemptible_runs_create",
        } <= indexes
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        assert not any("0004" in r[0] for r in conn.execute("SELECT name FROM sqlite_master"))
        conn.execute("PRAGMA foreign_keys=ON")
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute(
                "INSERT INTO preemptible_attempts (run_id, number, agent, host, started_at) "
                "VALUES ('no-such-run', 1, 'a', 'h', 0)"
            )
    finally:
        conn.close()


# -- metric.target ------------------------------------------------------------------------
def test_a_reached_target_starts_nothing_new_but_runs_that_ran_go_on(store: Store) -> None:
    spec = {
        "program": "train.py",
        "method": "random",
        "metric": {"name": "loss", "goal": "minimize", "target": 0.1},
        "parameters": {"lr": {"values": [1, 2]}},
    }
    sweep = store.create_sweep(spec, name=None, run_cap=None, max_failures=0, max_preemptions=5)
    store.add_runs(sweep, [{"lr": 9}])  # a pending run that never ran

    def propose(history: Any, index: int) -> dict[str, Any]:
        return {"lr": index}

    def take() -> Any:
        return store.claim(sweep, agent="a", host="h", lease=60, propose=propose)

    first, second = take(), take()
    assert first is not None and second is not None
    assert store.target_reached(sweep) is None
    store.report(first.run_id, {"loss": 0.5}, epoch=first.epoch)
    assert store.target_reached(sweep) is None
    store.report(second.run_id, {"loss": 0.1}, epoch=second.epoch)  # at the target: reached
    assert store.target_reached(sweep) == (second.run_id, 0.1)
    values = {"exit_code": 143, "duration": 1.0, "checkpoint_step": 1, "summary": None}
    store.finish(
        first.run_id, agent="a", attempt=1, epoch=first.epoch, ending=Ending.PREEMPTED, **values
    )
    again = take()  # the preempted run ran before: it goes on
    assert again is not None and again.run_id == first.run_id
    assert take() is None  # nothing new: neither a new run nor the one that never ran
    header = snapshot(store, sweep)["sweep"]
    assert header["target"] == {"value": 0.1, "run_id": second.run_id, "metric": 0.1}
    text = render_header(header)
    assert f"target loss=0.1 reached by {second.run_id}" in text


def render_header(header: dict[str, Any]) -> str:
    return _header_line(header, float(header["created_at"])).plain
