"""The sweep queue against a real SQLite file and a real PostgreSQL server (``store_url`` runs
every test on both): claim order, budgets, control, leases, idempotent retries, migrations,
and agents in separate processes claiming at once (PREEMPTIBLE_STRESS_SCALE sizes the stress
test: 8 agents x 50 runs each at scale 1, the issue's 8 x 500 at scale 10)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from preemptible import ConfigError
from preemptible._errors import DatabaseGone, LeaseLost, StoreError
from preemptible.sweeps.spec._sample import Observation
from preemptible.sweeps.store._endings import LEASE_EXPIRED, LEASE_MARGIN, recovery_hold
from preemptible.sweeps.store._queue import Store, open_store
from preemptible.sweeps.store._rows import Claim, Orders
from tests.conftest import ROOT, Child, wait_for
from tests.integration.sweep_claimer import expire_twice
from tests.support.postgres import PgServer

pytestmark = pytest.mark.timeout(120)

WORKER = ROOT / "tests" / "integration" / "sweep_claimer.py"
SCALE = float(os.environ.get("PREEMPTIBLE_STRESS_SCALE", "1"))


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = open_store(store_url, retry_timeout=30)
    yield s
    s.close()


def new_sweep(store: Store, **kwargs: Any) -> str:
    options: dict[str, Any] = {
        "name": "test",
        "run_cap": None,
        "max_failures": 0,
        "max_preemptions": 3,
    }
    options.update(kwargs)
    spec = options.pop("spec", {"metric": {"name": "loss", "goal": "minimize"}})
    return store.create_sweep(spec, **options)


def claim(store: Store, sweep: str, agent: str = "a1", lease: float = 60, propose=None):
    return store.claim(sweep, agent=agent, host="host-1", lease=lease, propose=propose)


def finish(store: Store, c: Claim, ending: str, agent: str = "a1", **kwargs: Any) -> str:
    values: dict[str, Any] = {
        "exit_code": {"FINISHED": 0, "FAILED": 1}.get(ending, 143),
        "duration": 1.5,
        "checkpoint_step": 10,
        "summary": None,
    }
    values.update(kwargs)
    return store.finish(c.run_id, agent=agent, attempt=c.attempt, ending=ending, **values)


def worker(spawn: Callable[..., Child], url: str, mode: str, *args: str) -> Child:
    env = {"PREEMPTIBLE_DB_RETRY_TIMEOUT": "90"}
    return spawn([sys.executable, str(WORKER), "--db", url, "--mode", mode, *args], env=env)


# -- claims -----------------------------------------------------------------------------------
def test_claims_take_requeued_runs_first_then_the_oldest(store: Store) -> None:
    sweep = new_sweep(store)
    ids = store.add_runs(sweep, [{"x": i} for i in range(3)])
    first = claim(store, sweep)
    assert first is not None
    assert (first.run_id, first.attempt, first.params, first.index) == (ids[0], 1, {"x": 0}, 0)
    second = claim(store, sweep, agent="a2")
    assert second is not None and second.run_id == ids[1]
    assert finish(store, first, "PREEMPTED") == "PENDING"
    again = claim(store, sweep, agent="a3")  # the preempted run, before the never-run ids[2]
    assert again is not None
    assert (again.run_id, again.attempt, again.params) == (ids[0], 2, {"x": 0})
    assert again.checkpoint_dir == first.checkpoint_dir == ids[0]
    assert again.preemptions == 1
    last = claim(store, sweep, agent="a3")
    assert last is not None and last.run_id == ids[2]
    assert claim(store, sweep) is None  # nothing pending, and no propose


def test_propose_sees_the_history_and_the_index_until_the_run_cap(store: Store) -> None:
    sweep = new_sweep(store, run_cap=3)
    seen: list[tuple[list[Observation], int]] = []

    def propose(history: list[Observation], index: int) -> dict[str, Any]:
        seen.append((list(history), index))
        return {"lr": 10.0**-index}

    for expected in range(3):
        c = claim(store, sweep, propose=propose)
        assert c is not None and c.index == expected and c.params == {"lr": 10.0**-expected}
        assert c.run_id == f"{sweep}-{expected}"
        finish(store, c, "FINISHED", summary={"loss": 1.0 / (expected + 1), "other": "x"})
    assert claim(store, sweep, propose=propose) is None  # run_cap reached: propose not asked
    assert [index for _, index in seen] == [0, 1, 2]
    assert seen[2][0] == [
        Observation({"lr": 1.0}, 1.0, True),
        Observation({"lr": 0.1}, 0.5, True),
    ]
    assert store.sweep(sweep).runs_created == 3


def test_propose_none_creates_nothing(store: Store) -> None:
    sweep = new_sweep(store)
    assert claim(store, sweep, propose=lambda history, index: None) is None
    assert store.runs(sweep) == []
    assert store.sweep(sweep).runs_created == 0


def test_history_reports_the_sweep_metric(store: Store) -> None:
    sweep = new_sweep(store)
    store.add_runs(sweep, [{"x": 1}, {"x": 2}, {"x": 3}])
    a = claim(store, sweep)
    b = claim(store, sweep)
    assert a is not None and b is not None
    store.report(a.run_id, {"loss": 0.7, "step": 3})
    store.report(b.run_id, {"loss": "not a number"})
    finish(store, a, "FINISHED", summary={"loss": 0.25})
    assert store.history(sweep) == [
        Observation({"x": 1}, 0.25, True),
        Observation({"x": 2}, None, False),
        Observation({"x": 3}, None, False),
    ]
    assert store.runs(sweep)[1].summary == {"loss": "not a number"}


def test_create_sweep_stores_spec_budgets_and_a_seed(store: Store) -> None:
    sweep = new_sweep(store, spec={"method": "grid", "nested": {"a": [1, 2]}}, run_cap=7)
    row = store.sweep(sweep)
    assert row.spec == {"method": "grid", "nested": {"a": [1, 2]}}
    assert (row.run_cap, row.max_failures, row.max_preemptions) == (7, 0, 3)
    assert isinstance(row.seed, int) and row.control == "running" and not row.cancel_now
    assert len(sweep) == 8 and sweep.isalnum()
    seeded = new_sweep(store, seed=12345)
    assert store.sweep(seeded).seed == 12345
    assert [s.id for s in store.sweeps()] == [sweep, seeded]
    with pytest.raises(ConfigError, match=r"^no sweep 'nope' in "):
        store.sweep("nope")
    with pytest.raises(ConfigError, match="max_failures=-1 is not valid"):
        new_sweep(store, max_failures=-1)
    with pytest.raises(ConfigError, match="not JSON-serializable"):
        new_sweep(store, spec={"x": float("nan")})


# -- control ----------------------------------------------------------------------------------
@pytest.mark.parametrize("control", ["stopped", "paused"])
def test_stop_and_pause_refuse_claims_and_reach_heartbeats(store: Store, control: str) -> None:
    sweep = new_sweep(store)
    store.add_runs(sweep, [{"x": 1}, {"x": 2}])
    c = claim(store, sweep)
    assert c is not None
    store.set_control(sweep, control)  # type: ignore[arg-type]
    assert claim(store, sweep, agent="a2") is None
    assert store.heartbeat(c.run_id, agent="a1", lease=60, attempt=1) == Orders(control, False)
    assert finish(store, c, "FINISHED") == "FINISHED"  # the running run finishes
    store.set_control(sweep, "running")
    resumed = claim(store, sweep, agent="a2")
    assert resumed is not None and resumed.params == {"x": 2}


def test_cancel_cancels_pending_runs_and_reaches_running_ones(store: Store) -> None:
    sweep = new_sweep(store)
    ids = store.add_runs(sweep, [{"x": 1}, {"x": 2}, {"x": 3}])
    c = claim(store, sweep)
    done = claim(store, sweep)
    assert c is not None and done is not None
    store.set_control(sweep, "cancelled")
    assert store.heartbeat(c.run_id, agent="a1", lease=60, attempt=1) == Orders("cancelled", False)
    store.set_control(sweep, "cancelled", now=True)
    assert store.heartbeat(c.run_id, agent="a1", lease=60, attempt=1) == Orders("cancelled", True)
    assert claim(store, sweep, propose=lambda h, i: {"x": 9}) is None
    assert finish(store, c, "PREEMPTED") == "CANCELLED"
    assert finish(store, done, "FINISHED") == "FINISHED"  # it did finish
    assert [r.state for r in store.runs(sweep)] == ["CANCELLED", "FINISHED", "CANCELLED"]
    assert store.runs(sweep)[2].id == ids[2]
    with pytest.raises(ConfigError, match="cancelled sweep cannot be running"):
        store.set_control(sweep, "running")
    with pytest.raises(ConfigError, match="now=True goes only with"):
        store.set_control(sweep, "stopped", now=True)
    with pytest.raises(ConfigError, match="control='bogus' is not valid; use one of running"):
        store.set_control(sweep, "bogus")  # type: ignore[arg-type]


# -- endings and budgets ----------------------------------------------------------------------
def test_finish_is_idempotent_and_refuses_other_agents(store: Store) -> None:
    sweep = new_sweep(store)
    store.add_runs(sweep, [{"x": 1}])
    c = claim(store, sweep)
    assert c is not None
    with pytest.raises(LeaseLost, match="no longer held by agent 'intruder'"):
        finish(store, c, "FINISHED", agent="intruder")
    assert finish(store, c, "FINISHED", summary={"loss": 0.1}) == "FINISHED"
    assert finish(store, c, "FINISHED", summary={"loss": 0.1}) == "FINISHED"
    with pytest.raises(LeaseLost):
        finish(store, c, "FINISHED", agent="intruder")
    [attempt] = store.attempts(c.run_id)
    assert (attempt.number, attempt.agent, attempt.host) == (1, "a1", "host-1")
    assert (attempt.ending, attempt.exit_code, attempt.duration) == ("FINISHED", 0, 1.5)
    assert (attempt.checkpoint_step, attempt.outcome, attempt.closed_by) == (10, "FINISHED", "a1")
    assert attempt.ended_at is not None and attempt.ended_at >= attempt.started_at
    run = store.run(c.run_id)
    assert (run.state, run.summary, run.lease_owner) == ("FINISHED", {"loss": 0.1}, None)
    with pytest.raises(ConfigError, match="ending='DONE' is not valid"):
        finish(store, c, "DONE")
    with pytest.raises(ConfigError, match=r"^no run 'nope' in "):
        store.finish(
            "nope",
            agent="a1",
            attempt=1,
            ending="FINISHED",
            exit_code=0,
            duration=1,
            checkpoint_step=None,
            summary=None,
        )


@pytest.mark.parametrize(
    ("ending", "budget", "final"),
    [
        ("FAILED", {"max_failures": 2}, "FAILED"),
        ("CRASHED", {"max_failures": 2}, "CRASHED"),
        ("PREEMPTED", {"max_preemptions": 2}, "PREEMPTED"),
    ],
)
def test_budgets(store: Store, ending: str, budget: dict[str, int], final: str) -> None:
    sweep = new_sweep(store, **{"max_failures": 0, "max_preemptions": 0, **budget})
    [run_id] = store.add_runs(sweep, [{"x": 1}])
    states = []
    for _ in range(3):
        c = claim(store, sweep)
        assert c is not None and c.run_id == run_id
        states.append(finish(store, c, ending))
    assert states == ["PENDING", "PENDING", final]  # 1 + budget tries
    assert claim(store, sweep) is None
    run = store.run(run_id)
    counted = "failures" if ending != "PREEMPTED" else "preemptions"
    assert getattr(run, counted) == 3 and run.attempt == 3
    assert [a.ending for a in store.attempts(run_id)] == [ending] * 3


def test_killed_and_cancelled_endings_end_the_run(store: Store) -> None:
    sweep = new_sweep(store, max_failures=5, max_preemptions=5)
    store.add_runs(sweep, [{"x": 1}, {"x": 2}])
    a = claim(store, sweep)
    b = claim(store, sweep)
    assert a is not None and b is not None
    assert finish(store, a, "KILLED", exit_code=130) == "KILLED"
    assert finish(store, b, "CANCELLED") == "CANCELLED"


def test_release_hands_the_run_back_without_using_a_budget(store: Store) -> None:
    sweep = new_sweep(store, max_failures=0, max_preemptions=0)
    ids = store.add_runs(sweep, [{"x": 1}, {"x": 2}])
    c = claim(store, sweep)
    assert c is not None
    store.release(c.run_id, agent="a1", attempt=1)
    store.release(c.run_id, agent="a1", attempt=1)  # a retry: nothing changes
    run = store.run(c.run_id)
    assert (run.state, run.preemptions, run.failures, run.lease_owner) == ("PENDING", 0, 0, None)
    again = claim(store, sweep, agent="a2")
    assert again is not None and (again.run_id, again.attempt) == (ids[0], 2)
    assert [(a.ending, a.outcome) for a in store.attempts(ids[0])] == [
        ("RELEASED", "PENDING"),
        (None, None),
    ]
    with pytest.raises(LeaseLost):
        store.release(c.run_id, agent="a1", attempt=2)


# -- leases -----------------------------------------------------------------------------------
def expire(store: Store) -> list[str]:
    return wait_for(store.expire_leases, 30, "a lease to expire")  # type: ignore[return-value]


def test_an_expired_lease_requeues_the_run_once(store: Store) -> None:
    sweep = new_sweep(store, max_preemptions=1)
    [run_id, other] = store.add_runs(sweep, [{"x": 1}, {"x": 2}])
    c = claim(store, sweep, lease=0.2)
    assert c is not None
    assert store.heartbeat(run_id, agent="a1", lease=0.2, attempt=1).control == "running"
    assert expire(store) == [run_id]
    assert store.expire_leases() == []
    run = store.run(run_id)
    assert (run.state, run.attempt, run.preemptions, run.failures) == ("PENDING", 1, 1, 0)
    [attempt] = store.attempts(run_id)
    assert (attempt.ending, attempt.outcome, attempt.closed_by) == (
        "CRASHED",
        "PENDING",
        LEASE_EXPIRED,
    )
    # the agent that lost it learns so at its next heartbeat
    with pytest.raises(LeaseLost, match="no longer held"):
        store.heartbeat(run_id, agent="a1", lease=60, attempt=1)
    # the next one, marked preempting at start, is lost too: PREEMPTED, and the budget is spent
    again = claim(store, sweep, agent="a2", lease=0.2)
    assert again is not None and again.attempt == 2
    store.mark_preempting(run_id, attempt=2)
    assert expire(store) == [run_id]
    assert store.run(run_id).state == "PREEMPTED"
    assert [a.ending for a in store.attempts(run_id)] == ["CRASHED", "PREEMPTED"]
    # ...and once another attempt started, the first agent's result is not taken
    with pytest.raises(LeaseLost):
        finish(store, c, "FINISHED")
    assert store.run(other).state == "PENDING"


def test_a_result_after_the_lease_ran_out_is_kept_while_no_other_attempt_started(
    store: Store,
) -> None:
    """The holder was cut off past its lease and another agent ended the attempt as lost; its
    result (FINISHED, exit 0) still counts: FINISHED after 1 attempt, no preemption counted."""
    sweep = new_sweep(store, max_preemptions=0)
    [run_id] = store.add_runs(sweep, [{"x": 1}])
    c = claim(store, sweep, lease=0.2)
    assert c is not None
    assert expire(store) == [run_id]
    assert store.run(run_id).state == "CRASHED"  # no preemption left: final, for now
    assert finish(store, c, "FINISHED", summary={"loss": 0.5}) == "FINISHED"
    assert finish(store, c, "FINISHED") == "FINISHED"  # a retry of the same call
    run = store.run(run_id)
    assert (run.state, run.attempt, run.preemptions, run.summary) == (
        "FINISHED",
        1,
        0,
        {"loss": 0.5},
    )
    [attempt] = store.attempts(run_id)
    assert (attempt.ending, attempt.exit_code, attempt.closed_by) == ("FINISHED", 0, "a1")
    # a late PREEMPTED result of another run: back in the queue, one preemption, not two
    [second] = store.add_runs(sweep, [{"x": 2}])
    sweep2 = new_sweep(store, max_preemptions=3)
    [third] = store.add_runs(sweep2, [{"x": 3}])
    d = claim(store, sweep2, lease=0.2)
    assert d is not None and d.run_id == third
    assert expire(store) == [third]
    assert finish(store, d, "PREEMPTED") == "PENDING"
    assert store.run(third).preemptions == 1
    assert [a.ending for a in store.attempts(third)] == ["PREEMPTED"]
    assert store.run(second).state == "PENDING"


def test_every_claim_moves_the_epoch_on_and_stale_epochs_are_refused(store: Store) -> None:
    sweep = new_sweep(store, max_preemptions=5)
    [run_id] = store.add_runs(sweep, [{"x": 1}])
    first = claim(store, sweep)
    assert first is not None and first.epoch == 1
    assert store.attempts(run_id)[0].epoch == 1
    assert finish(store, first, "PREEMPTED", epoch=1) == "PENDING"
    second = claim(store, sweep, agent="a1")  # the same agent, the same run, a new claim
    assert second is not None and (second.attempt, second.epoch) == (2, 2)
    with pytest.raises(LeaseLost):
        store.heartbeat(run_id, agent="a1", lease=60, attempt=2, epoch=1)
    with pytest.raises(LeaseLost):
        store.report(run_id, {"loss": 1.0}, epoch=1)
    with pytest.raises(LeaseLost):
        finish(store, second, "FINISHED", epoch=1)
    assert store.heartbeat(run_id, agent="a1", lease=60, attempt=2, epoch=2).control == "running"
    store.report(run_id, {"loss": 2.0}, epoch=2)
    # a claim whose attempt never started is undone: no attempt counted, the epoch kept
    store.abandon(run_id, agent="a1", attempt=2, epoch=2)
    run = store.run(run_id)
    assert (run.state, run.attempt, run.epoch, run.lease_owner) == ("PENDING", 1, 2, None)
    assert [a.number for a in store.attempts(run_id)] == [1]
    with pytest.raises(LeaseLost):
        store.abandon(run_id, agent="a1", attempt=2, epoch=2)
    third = claim(store, sweep, agent="a2")
    assert third is not None and (third.attempt, third.epoch) == (2, 3)
    with pytest.raises(LeaseLost):  # the abandoned claim's holder cannot finish attempt 2
        finish(store, third, "FINISHED", agent="a1", epoch=2)
    assert finish(store, third, "FINISHED", agent="a2", epoch=3) == "FINISHED"


def test_history_is_fenced_replaced_by_step_trimmed_and_read_per_sweep(store: Store) -> None:
    sweep = new_sweep(store, max_preemptions=5)
    run_a, run_b = store.add_runs(sweep, [{"x": 1}, {"x": 2}])
    first = claim(store, sweep)
    assert first is not None and first.run_id == run_a
    points = [(1, "loss", 3.0), (2, "loss", 2.0), (2, "acc", 0.5), (3, "loss", 1.5)]
    store.add_history(run_a, points, attempt=1, epoch=first.epoch)
    store.add_history(run_a, [(3, "loss", 1.25)], attempt=1, epoch=first.epoch)  # replaces
    # what the queue cannot hold is left out: a step beyond 64 bits, NaN
    store.add_history(run_a, [(2**63, "loss", 1.0), (4, "loss", float("nan"))], attempt=1, epoch=1)
    assert store.run_history(run_a) == {
        "acc": [(2, 0.5, 1)],
        "loss": [(1, 3.0, 1), (2, 2.0, 1), (3, 1.25, 1)],
    }
    assert finish(store, first, "PREEMPTED", epoch=first.epoch, checkpoint_step=2) == "PENDING"
    with pytest.raises(LeaseLost):  # no longer held: nothing is written
        store.add_history(run_a, [(9, "loss", 9.0)], attempt=1, epoch=first.epoch)
    second = claim(store, sweep)
    assert second is not None and second.run_id == run_a
    with pytest.raises(LeaseLost):
        store.trim_history(run_a, 0, epoch=first.epoch)
    store.trim_history(run_a, 2, epoch=second.epoch)  # it resumes from step 2
    store.add_history(run_a, [(3, "loss", 1.0)], attempt=2, epoch=second.epoch)
    assert store.run_history(run_a)["loss"] == [(1, 3.0, 1), (2, 2.0, 1), (3, 1.0, 2)]
    other = claim(store, sweep, agent="a2")
    assert other is not None and other.run_id == run_b
    store.add_history(run_b, [(5, "loss", 0.5), (1, "loss", 0.75)], attempt=1, epoch=other.epoch)
    assert store.histories(sweep, "loss") == {
        run_a: [(1, 3.0), (2, 2.0), (3, 1.0)],
        run_b: [(1, 0.75), (5, 0.5)],
    }
    assert store.histories(sweep, "acc") == {run_a: [(2, 0.5)]}
    store.trim_history(run_b, None, epoch=other.epoch)  # no checkpoint: it starts over
    assert store.run_history(run_b) == {}


def test_the_judge_reading_band_values_decides_as_on_the_whole_histories(store: Store) -> None:
    """Hyperband's judge reads its run's points and only the others' n-th values at the
    bands (picked in SQL, by step order, whatever order the points came in): each run's
    verdict is the one ``judge`` gives on every point of the sweep."""
    import random

    from preemptible.sweeps.agent._early import Judge, judge
    from preemptible.sweeps.spec._hyperband import parse_early_terminate
    from preemptible.sweeps.spec._spec import parse_spec

    early = {"type": "hyperband", "min_iter": 2, "eta": 2}
    spec = {"program": "t.py", "method": "grid", "metric": {"name": "loss", "goal": "minimize"}}
    lengths = [30, 30, 30, 17, 9, 9, 5, 3, 1, 0]  # the later runs shorter and worse
    spec |= {"parameters": {"x": {"values": lengths}}, "early_terminate": early}
    sweep = store.create_sweep(spec, name=None, run_cap=None, max_failures=0, max_preemptions=0)
    ids = store.add_runs(sweep, [{"x": n} for n in lengths])
    rng = random.Random(7)
    full: dict[str, list[tuple[int, float]]] = {}
    for k, run_id in enumerate(ids):
        held = claim(store, sweep, agent=f"a{k}")
        assert held is not None and held.run_id == run_id
        steps = sorted(rng.sample(range(1, 200), lengths[k]))  # gaps between the steps
        got = [(step, rng.uniform(0.1, 0.3) + k / 10) for step in steps]
        shuffled = rng.sample(got, len(got))  # stored out of order
        store.add_history(run_id, [(st, "loss", v) for st, v in shuffled], attempt=1, epoch=1)
        if got:
            full[run_id] = got
    config = parse_early_terminate(early)
    verdicts = {r: Judge(parse_spec(spec), sweep, r).check(store) for r in ids}
    assert verdicts == {r: judge(config, goal="minimize", histories=full, run_id=r) for r in ids}
    assert sum(v is not None for v in verdicts.values()) >= 2  # some are stopped, some not
    assert store.band_values(sweep, "loss", []) == {}


class FakeHost:
    """The store's ``Local`` for one agent: which holders live and which runs are held here."""

    def __init__(self, identity: str = "me") -> None:
        self.identity = identity
        self.alive: dict[str, bool] = {}
        self.held: dict[str, str] = {}

    def holder_alive(self, holder: str | None) -> bool | None:
        return self.alive.get(holder or "")

    def blocked(self, run_id: str) -> str | None:
        return self.held.get(run_id)


def test_a_holder_on_this_host_is_waited_for_while_it_lives(store: Store) -> None:
    sweep = new_sweep(store)
    [run_id] = store.add_runs(sweep, [{"x": 1}])
    holder, other = FakeHost("agent-a"), FakeHost("agent-b")
    assert store.claim(sweep, agent="a", host="h", lease=0.2, propose=None, local=holder)
    other.alive["agent-a"] = True  # stopped (SIGSTOP), but alive: its run is not taken
    wait_for(lambda: time.time() > (store.run(run_id).lease_expires or 0) + 0.2, 10, "expiry")
    assert store.claim(sweep, agent="b", host="h", lease=60, propose=None, local=other) is None
    assert store.run(run_id).state == "RUNNING"
    other.alive["agent-a"] = False  # gone, but a process of its attempt still holds a lock
    other.held[run_id] = "a process holds its checkpoint lock"
    assert store.expire_leases(local=other) == []
    del other.held[run_id]
    taken = store.claim(sweep, agent="b", host="h", lease=60, propose=None, local=other)
    assert taken is not None and (taken.run_id, taken.attempt) == (run_id, 2)


def test_a_holder_on_another_host_loses_the_run_only_a_margin_after_its_lease(
    store: Store,
) -> None:
    sweep = new_sweep(store)
    [run_id] = store.add_runs(sweep, [{"x": 1}])
    c = claim(store, sweep, lease=1.0)
    assert c is not None
    expires = store.run(run_id).lease_expires
    assert expires is not None
    here = FakeHost("elsewhere")  # knows nothing of the holder: another host
    found = wait_for(lambda: store.expire_leases(local=here), 30, "the takeover")
    assert found == [run_id]
    assert time.time() >= expires + LEASE_MARGIN * 1.0  # not before the margin
    # after an outage of its own, an agent gives holders elsewhere a lease to report first
    sweep2 = new_sweep(store)
    [run2] = store.add_runs(sweep2, [{"x": 2}])
    assert claim(store, sweep2, lease=0.2) is not None
    store._health.recovered_at = time.monotonic() - recovery_hold(0.2) + 1.0
    wait_for(lambda: time.time() > (store.run(run2).lease_expires or 0) + 0.1, 10, "expiry")
    assert store.expire_leases(local=here) == []
    assert wait_for(lambda: store.expire_leases(local=here), 30, "the hold to pass") == [run2]


def test_pending_runs_still_held_on_this_host_are_passed_over(store: Store) -> None:
    sweep = new_sweep(store)
    ids = store.add_runs(sweep, [{"x": 1}, {"x": 2}])
    here = FakeHost()
    here.held[ids[0]] = "an orphan of its last attempt holds its checkpoint lock"
    c = store.claim(sweep, agent="a", host="h", lease=60, propose=None, local=here)
    assert c is not None and c.run_id == ids[1]
    assert store.claim(sweep, agent="a", host="h", lease=60, propose=None, local=here) is None
    assert store.run(ids[0]).state == "PENDING"  # waiting, not failed


def test_claim_expires_leases_first(store: Store) -> None:
    sweep = new_sweep(store)
    [run_id] = store.add_runs(sweep, [{"x": 1}])
    assert claim(store, sweep, lease=0.1) is not None
    c = wait_for(lambda: claim(store, sweep, agent="a2"), 30, "the run to come back")
    assert isinstance(c, Claim) and (c.run_id, c.attempt) == (run_id, 2)


def lose_every_agent(store: Store, sweep: str, runs: int) -> None:
    """Each run claimed by an agent that is then lost: all leases have run out on return."""
    # a long lease first: a claim expires the leases that have run out, and takes them again
    claims = [claim(store, sweep, agent=f"lost-{i}", lease=60) for i in range(runs)]
    for c in claims:
        assert c is not None
        store.heartbeat(c.run_id, agent=f"lost-{c.index}", lease=0.001, attempt=1)
    wait_for(
        lambda: time.time() > max(r.lease_expires or 0 for r in store.runs(sweep)) + 0.01,
        10,
        "every lease to run out",
    )


def test_racing_expirers_in_threads_requeue_each_run_once(store_url: str, store: Store) -> None:
    sweep = new_sweep(store)
    ids = store.add_runs(sweep, [{"x": i} for i in range(20)])
    stores = [open_store(store_url, retry_timeout=30) for _ in range(4)]
    lose_every_agent(store, sweep, 20)
    barrier = threading.Barrier(len(stores))
    results: list[list[str]] = []

    def expirer(s: Store) -> None:
        barrier.wait(timeout=30)
        results.append(expire_twice(s))

    threads = [threading.Thread(target=expirer, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for s in stores:
        s.close()
    assert len(results) == len(stores)
    assert sorted(r for found in results for r in found) == sorted(ids)
    for run in store.runs(sweep):
        assert (run.state, run.preemptions) == ("PENDING", 1)
        assert [a.closed_by for a in store.attempts(run.id)] == [LEASE_EXPIRED]


def test_racing_expirers_in_processes_requeue_each_run_once(
    store_url: str, store: Store, spawn: Callable[..., Child], tmp_path: Path
) -> None:
    sweep = new_sweep(store)
    ids = store.add_runs(sweep, [{"x": i} for i in range(30)])
    go = tmp_path / "go"
    children = [worker(spawn, store_url, "expire", "--go", str(go)) for _ in range(4)]
    for child in children:
        child.wait_line(lambda line: line == "ready", 60)
    lose_every_agent(store, sweep, 30)
    go.touch()
    found = []
    for child in children:
        assert child.wait(60) == 0, child.output
        found += json.loads(child.lines[-1])
    assert sorted(found) == sorted(ids)
    assert {(r.state, r.preemptions) for r in store.runs(sweep)} == {("PENDING", 1)}


def test_an_sqlite_file_deleted_or_replaced_under_its_users_stops_them_and_is_not_recreated(
    tmp_path: Path,
) -> None:
    path = tmp_path / "q.db"
    url = f"sqlite://{path}"
    store = open_store(url)
    sweep = new_sweep(store)
    beat = store.reopen()  # a heartbeat thread's connection
    assert beat.sweep(sweep).id == sweep
    path.unlink()
    for user in (store, beat):
        with pytest.raises(DatabaseGone, match=r"q\.db was deleted while in use; nothing is"):
            user.sweep(sweep)
    with pytest.raises(DatabaseGone, match="was deleted"):
        store.reopen()  # a new heartbeat thread does not make a new empty file either
    assert not path.exists()
    with pytest.raises(DatabaseGone, match=r"^no sweep database at sqlite://.*q\.db \(deleted"):
        open_store(url, create=False)  # an agent, status, sweep stop
    assert not path.exists()
    store.close()
    beat.close()
    fresh = open_store(url)  # `sweep create` makes a new one
    sweep = new_sweep(fresh)
    copy = tmp_path / "copy.db"
    open_store(f"sqlite://{copy}").close()
    os.replace(copy, path)
    with pytest.raises(DatabaseGone, match="was replaced by another file"):
        fresh.sweep(sweep)
    fresh.close()


# -- retries: a commit whose acknowledgement is lost ------------------------------------------
def lose_one_acknowledgement(store: Store) -> None:
    """The next transaction commits, then fails as a dropped connection would."""
    backend = store._backend
    real = backend.transaction
    if backend.kind == "sqlite":
        import sqlite3

        lost: Exception = sqlite3.OperationalError("database is locked")
    else:
        import psycopg

        lost = psycopg.OperationalError("server closed the connection unexpectedly")

    @contextlib.contextmanager
    def transaction(conn: Any, *, write: bool) -> Iterator[Any]:
        with real(conn, write=write) as cursor:
            yield cursor
        backend.transaction = real  # type: ignore[method-assign]
        raise lost

    backend.transaction = transaction  # type: ignore[method-assign]


def test_a_claim_retried_after_a_lost_commit_returns_the_same_run(store: Store) -> None:
    sweep = new_sweep(store)
    ids = store.add_runs(sweep, [{"x": 1}, {"x": 2}])
    lose_one_acknowledgement(store)
    c = claim(store, sweep)
    assert c is not None and (c.run_id, c.attempt) == (ids[0], 1)
    assert [(r.state, r.attempt) for r in store.runs(sweep)] == [("RUNNING", 1), ("PENDING", 0)]
    assert len(store.attempts(ids[0])) == 1


def test_a_created_run_retried_after_a_lost_commit_is_created_once(store: Store) -> None:
    sweep = new_sweep(store)
    lose_one_acknowledgement(store)
    c = claim(store, sweep, propose=lambda history, index: {"i": index})
    assert c is not None and c.index == 0
    assert [r.index for r in store.runs(sweep)] == [0]


def test_other_writes_retried_after_a_lost_commit_happen_once(store: Store) -> None:
    lose_one_acknowledgement(store)
    sweep = new_sweep(store)
    assert [s.id for s in store.sweeps()] == [sweep]
    lose_one_acknowledgement(store)
    ids = store.add_runs(sweep, [{"x": 1}, {"x": 2}])
    assert [r.id for r in store.runs(sweep)] == ids
    c = claim(store, sweep)
    assert c is not None
    lose_one_acknowledgement(store)
    assert finish(store, c, "PREEMPTED") == "PENDING"
    assert store.run(c.run_id).preemptions == 1


# -- migrations -------------------------------------------------------------------------------
def raw_execute(url: str, sql: str) -> None:
    if url.startswith("sqlite:"):
        import sqlite3

        with contextlib.closing(sqlite3.connect(url[len("sqlite://") :])) as conn, conn:
            conn.execute(sql)
    else:
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql)  # type: ignore[call-overload]


def test_migrations_run_once_and_refuse_a_newer_schema(store_url: str, store: Store) -> None:
    sweep = new_sweep(store)
    assert store.schema_versions() == [1, 2, 3, 4, 5]
    with open_store(store_url) as again:  # every migration is there: nothing is applied
        assert again.schema_versions() == [1, 2, 3, 4, 5]
        assert again.sweep(sweep).id == sweep
    raw_execute(store_url, "INSERT INTO preemptible_schema VALUES (99, 0)")
    with pytest.raises(StoreError, match=r"schema version 99; .* upgrade preemptible"):
        open_store(store_url)


def test_agents_opening_a_new_database_together_migrate_it_once(
    store_url: str, spawn: Callable[..., Child], tmp_path: Path
) -> None:
    go = tmp_path / "go"
    children = [worker(spawn, store_url, "open", "--go", str(go)) for _ in range(6)]
    for child in children:
        child.wait_line(lambda line: line == "ready", 60)
    go.touch()
    for child in children:
        assert child.wait(60) == 0, child.output
        assert child.lines[-1] == "opened"
    with open_store(store_url) as s:
        assert s.schema_versions() == [1, 2, 3, 4, 5]


# -- URLs and passwords -----------------------------------------------------------------------
def test_an_unreachable_server_is_retried_then_named_without_its_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = "postgresql://alice:s3cr%40t-pw@127.0.0.1:1/sweeps"
    caplog.set_level(logging.DEBUG)
    started = time.monotonic()
    with pytest.raises(StoreError) as raised:
        open_store(url, retry_timeout=0.5)
    assert time.monotonic() - started >= 0.2  # it did retry
    message = str(raised.value)
    assert "postgresql://alice:***@127.0.0.1:1/sweeps" in message
    assert "gave up after" in message and "PREEMPTIBLE_DB_RETRY_TIMEOUT" in message
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert "unreachable or locked" in caplog.text
    for secret in ("s3cr", "s3cr%40t-pw", "s3cr@t-pw"):
        assert secret not in message and secret not in caplog.text


@pytest.mark.parametrize("where", ["user part", "query"])
def test_a_wrong_password_fails_at_once_and_is_not_shown(pg_server: PgServer, where: str) -> None:
    with contextlib.suppress(Exception):
        pg_server.admin("CREATE ROLE preemptible_pw LOGIN PASSWORD 'the-right-one'")
    host = pg_server.url.split("@", 1)[1].split("/", 1)[0]
    if where == "user part":
        url = f"postgresql://preemptible_pw:Wr0ng-Pa55@{host}/postgres"
    else:
        url = f"postgresql://preemptible_pw@{host}/postgres?password=Wr0ng-Pa55"
    started = time.monotonic()
    try:
        store = open_store(url, retry_timeout=60)
    except StoreError as exc:
        message = str(exc)
    else:
        store.close()
        pytest.skip("this PostgreSQL server accepts any password for preemptible_pw")
    assert time.monotonic() - started < 30  # not retried until the deadline
    assert "password authentication failed" in message
    assert "Wr0ng-Pa55" not in message and "***" in message


def test_bad_urls_are_refused_in_one_line_without_the_password(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        open_store("mysql://root:hunter2@db/sweeps")
    assert str(raised.value) == (
        "database URL 'mysql://root:***@db/sweeps' is not valid; use sqlite:///ABS/PATH.db, "
        "sqlite:REL/PATH.db or postgresql://USER:PASSWORD@HOST:PORT/DB"
    )
    with pytest.raises(ConfigError, match="contains '@'; write it as %40") as raised:
        open_store("postgresql://u:p@ss@db/sweeps")
    assert "p@ss" not in str(raised.value)
    unwritable = tmp_path / "file"
    unwritable.write_text("not a directory")
    with pytest.raises(
        StoreError, match=re.escape(f"cannot use the sweep database sqlite://{unwritable}/x/")
    ):
        open_store(f"sqlite://{unwritable}/x/sweeps.db")


def test_a_server_out_of_connection_slots_is_waited_for(
    pg_server: PgServer, pg_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLSTATE 53300 (too many connections; here a role allowed one) is retried with backoff,
    said once with its cause, and the store opens once the slot is free."""
    import psycopg

    with contextlib.suppress(Exception):
        pg_server.admin("CREATE ROLE preemptible_one LOGIN CONNECTION LIMIT 1")
    pg_server.admin(f'ALTER DATABASE "{pg_database}" OWNER TO preemptible_one')
    url = pg_server.database_url(pg_database).replace("postgres@", "preemptible_one@", 1)
    caplog.set_level(logging.INFO, logger="preemptible")
    opened: list[object] = []

    def open_it() -> None:
        with open_store(url, retry_timeout=30) as store:
            opened.append(store.schema_versions())

    holder = psycopg.connect(url, autocommit=True, connect_timeout=30)
    thread = threading.Thread(target=open_it, daemon=True)
    thread.start()
    try:
        wait_for(lambda: "is out of connection slots" in caplog.text, 15, "the warning")
    finally:
        holder.close()
    thread.join(60)
    assert opened, caplog.text
    assert caplog.text.count("out of connection slots") == 1 and "answers again" in caplog.text


def test_a_driver_message_keeps_its_words_whatever_the_password(
    pg_server: PgServer, pg_database: str
) -> None:
    """The scrubber once replaced every 2-letter piece of the password: a password "ab/ss"
    turned "permission denied" into "permi***ion denied" (and so hinted at the password)."""
    with contextlib.suppress(Exception):
        pg_server.admin("CREATE ROLE preemptible_nocreate LOGIN")  # trusted: any password
    url = pg_server.database_url(pg_database)
    url = url.replace("postgres@", "preemptible_nocreate:ab%2Fss@", 1)
    with pytest.raises(StoreError) as raised:
        open_store(url, retry_timeout=5)  # it may not create the queue's tables
    message = str(raised.value)
    assert "permission denied for schema public" in message, message
    assert "preemptible_nocreate:***@" in message and "ab%2Fss" not in message


def status_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
    return subprocess.run(
        [sys.executable, "-m", "preemptible", "status", *args, "--db", url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PREEMPTIBLE_DB_RETRY_TIMEOUT": "5"},
    )


def test_status_reads_a_database_it_may_not_write(pg_server: PgServer, pg_database: str) -> None:
    """A standby, or a role whose transactions are read-only: status reads as it is (it used to
    fail migrating the schema, which is current); a writer still gets one clear line. (SQLite:
    test_sweep_status.py mounts the file system read-only.)"""
    name = pg_database
    with open_store(pg_server.database_url(name)) as store:
        sweep = new_sweep(store)
        store.add_runs(sweep, [{"x": 1}, {"x": 2}])
    url = pg_server.database_url(name) + "?options=-c%20default_transaction_read_only%3Don"
    table = status_cli(url, sweep)
    assert table.returncode == 0, table.stderr
    assert f"{sweep}-1" in table.stdout and "2 PENDING" in table.stdout
    assert len(json.loads(status_cli(url, sweep, "--json").stdout)["runs"]) == 2
    assert sweep in status_cli(url).stdout
    with pytest.raises(StoreError, match="read-only transaction"):
        open_store(url, retry_timeout=5)


def test_watch_marks_a_stale_table_while_the_server_refuses_and_recovers(
    pg_server: PgServer, pg_database: str, tmp_path: Path
) -> None:
    """``status --watch`` in a terminal: the database stops taking connections (its backends
    cut off), the last table is shown under "database unreachable since ..."; connections come
    back and the next table is current (a run added meanwhile shows)."""
    import pty
    import signal

    name = pg_database
    url = pg_server.database_url(name)
    master, slave = pty.openpty()
    proc = None
    chunks: list[bytes] = []
    try:
        with open_store(url) as store:
            sweep = new_sweep(store)
            store.add_runs(sweep, [{"x": 1}])
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
        env.update(COLUMNS="160", LINES="40", TERM="xterm", PREEMPTIBLE_DB_RETRY_TIMEOUT="1")
        proc = subprocess.Popen(
            [sys.executable, "-m", "preemptible", "status", sweep, "--watch", "0.3", "--db", url],
            stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
        )  # fmt: skip
        os.close(slave)
        slave = -1

        def read() -> None:
            with contextlib.suppress(OSError):  # EIO once the child is gone
                while data := os.read(master, 65536):
                    chunks.append(data)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()

        def output() -> str:
            return b"".join(chunks).decode("utf-8", "replace")

        wait_for(lambda: f"{sweep}-0" in output(), 60, "the first table")
        pg_server.admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        pg_server.admin(
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"
        )
        wait_for(lambda: "database unreachable since" in output(), 60, "the marker")
        assert "showing the last table" in output()
        pg_server.admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        with open_store(url) as store:
            store.add_runs(sweep, [{"x": 2}])
        wait_for(lambda: f"{sweep}-1" in output(), 60, "a current table")
        text = output()
        header = text.rfind(f"sweep {sweep}", 0, text.rfind(f"{sweep}-1"))
        assert header > 0 and "unreachable" not in text[header - 200 : header], text[header - 400 :]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, output()
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        os.close(master)
        if slave >= 0:
            os.close(slave)
        pg_server.admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')


# -- many agents ------------------------------------------------------------------------------
def run_agents(
    spawn: Callable[..., Child],
    url: str,
    tmp_path: Path,
    agents: int,
    runs: int,
    during: Callable[[Path], None] | None = None,
    work: float = 0.001,
) -> list[Child]:
    """``agents`` worker processes claim and finish ``runs`` pre-created runs; every run must
    end FINISHED after exactly one attempt, executed by exactly one agent."""
    with open_store(url) as s:
        sweep = s.create_sweep({}, name="stress", run_cap=None, max_failures=0, max_preemptions=0)
        ids = s.add_runs(sweep, [{"i": i} for i in range(runs)])
    log = tmp_path / "executed.log"
    go = tmp_path / "go"
    args = ["--sweep", sweep, "--log", str(log), "--go", str(go), "--work", str(work)]
    children = [worker(spawn, url, "claim", "--agent", f"agent-{n}", *args) for n in range(agents)]
    for child in children:
        child.wait_line(lambda line: line == "ready", 120)
    go.touch()
    if during is not None:
        during(log)
    for child in children:
        assert child.wait(600) == 0, child.output
    executed = Counter(line.split()[0] for line in log.read_text().splitlines())
    assert sorted(executed) == sorted(ids), "a run was never executed"
    assert [r for r, n in executed.items() if n > 1] == [], "a run was executed twice"
    with open_store(url) as s:
        states = Counter((r.state, r.attempt) for r in s.runs(sweep))
        assert states == {("FINISHED", 1): runs}
        for run_id in ids[:: max(1, runs // 20)]:
            assert [(a.number, a.ending) for a in s.attempts(run_id)] == [(1, "FINISHED")]
    assert sum(int(c.lines[-1].split()[1]) for c in children) == runs
    return children


@pytest.mark.slow
@pytest.mark.timeout(int(600 * max(SCALE, 1)))
def test_eight_agents_execute_every_run_exactly_once(
    store_url: str, spawn: Callable[..., Child], tmp_path: Path
) -> None:
    run_agents(spawn, store_url, tmp_path, agents=8, runs=max(8, round(8 * 50 * SCALE)))


@pytest.mark.timeout(300)
def test_a_postgresql_restart_mid_sweep_loses_nothing_and_runs_nothing_twice(
    own_pg_server: PgServer, spawn: Callable[..., Child], tmp_path: Path
) -> None:
    pg_server = own_pg_server
    runs = 240

    def restart_when_a_quarter_is_done(log: Path) -> None:
        def executed() -> int:
            return log.exists() and len(log.read_text().splitlines())

        wait_for(lambda: executed() >= runs // 4, 120, "a quarter of the runs")
        pg_server.restart()
        assert executed() < runs, "the sweep was over before the restart; make it longer"

    children = run_agents(
        spawn,
        pg_server.database_url("postgres"),
        tmp_path,
        4,
        runs,
        during=restart_when_a_quarter_is_done,
        work=0.02,
    )
    assert any("unreachable or locked" in c.output for c in children)
