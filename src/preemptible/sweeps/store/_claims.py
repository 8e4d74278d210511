"""The claim: how an agent takes its next run in one transaction (``take``): expired leases
taken over first, then the first pending run in line that can start here (``pick``), else a
new run with the sampler's parameters (``history`` is what it reads) under the run cap.

Once a run has reported the sweep metric at or beyond ``metric.target`` (``target_reached``),
the sweep starts nothing new, as W&B ends it: no new run, no pending run that never ran;
runs that already ran (preempted ones back in the queue, one resumed by hand) go on."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from ..._errors import ConfigError, StoreError
from ..._states import Control, QueueState
from ..spec._model import Goal, Metric
from ..spec._sample import Observation  # what ``propose`` reads: (params, metric, finished)
from ._connector import _Health, _Tx
from ._endings import Local, expire
from ._fields import decode_object, field_error
from ._rows import Claim, SweepRow, claim_row, sweep_row
from ._values import _json, _loads, _metric, _metric_name
from ._watch import BeatWatch

logger = logging.getLogger("preemptible")

PENDING_LOOKAHEAD = 16  # pending runs a claim looks at past those that cannot start here
Propose = Callable[[list[Observation], int], dict[str, Any] | None]


def sweep_of(tx: _Tx, sweep_id: str, display: str) -> SweepRow:
    """Sweep ``sweep_id`` (its spec readable), or a ConfigError naming the database."""
    row = tx.one("get_sweep", id=sweep_id)
    if row is None:
        raise ConfigError(f"no sweep {sweep_id!r} in {display}")
    return sweep_row(row)


def insert_run(tx: _Tx, sweep_id: str, index: int, params: str, token: str) -> str:
    run_id = f"{sweep_id}-{index}"
    tx.run("insert_run", id=run_id, sweep_id=sweep_id, run_index=index, params=params, token=token)
    return run_id


def take(
    tx: _Tx,
    sweep_id: str,
    *,
    agent: str,
    host: str,
    lease: float,
    token: str,
    holder: str | None,
    propose: Propose | None,
    local: Local | None,
    health: _Health,
    display: str,
    watch: BeatWatch | None = None,
) -> Claim | None:
    """The claim transaction of ``Store.claim``: ``token`` marks what it takes, so that a
    retry finds what an earlier try took; ``holder``: ``local``'s identity; ``watch``: on
    SQLite, this agent's record of the leases' renewals (``_watch``)."""
    if tx.retry:  # did an earlier try commit, its acknowledgement lost?
        mine = tx.one("claimed_by_token", token=token, agent=agent)
        if mine is not None:
            row = tx.one("claim_row", id=mine["id"])
            assert row is not None
            return claim_row(row)
    expire(tx, local, health, watch)
    sweep = sweep_of(tx, sweep_id, display)
    if sweep.control != Control.RUNNING:
        return None
    reached = target_reached(tx, sweep_id, sweep.spec) is not None
    picked = pick(tx, sweep_id, local)
    if picked is not None and reached and picked["attempt"] == 0:
        picked = None  # ran before are first in line: none is left
    if picked is None and propose is not None and not reached:
        locked = tx.one("lock_sweep", id=sweep_id)  # one creator at a time
        assert locked is not None
        if locked["control"] != Control.RUNNING:
            return None
        # a run may have come back, or been added, while this waited for the lock
        picked = pick(tx, sweep_id, local)
        if picked is None:
            index, cap = locked["runs_created"], locked["run_cap"]
            if cap is not None and index >= cap:
                return None
            params = propose(history(tx, sweep_id, sweep.spec), index)
            if params is None:
                return None
            text = _json(dict(params), "proposed parameters")
            run_id = insert_run(tx, sweep_id, index, text, token)
            tx.run("count_created", id=sweep_id, n=1)
            picked = {
                "id": run_id,
                "sweep_id": sweep_id,
                "run_index": index,
                "params": text,
                "attempt": 0,
                "checkpoint_dir": run_id,
                "preemptions": 0,
                "failures": 0,
                "lease_epoch": 0,
            }
    if picked is None:
        return None
    taken = tx.run(
        "take_run",
        id=picked["id"],
        agent=agent,
        host=host,
        lease=lease,
        token=token,
        holder=holder,
    )
    if taken != 1:
        raise StoreError(f"run {picked['id']} was picked but could not be taken")
    tx.run("insert_attempt", id=picked["id"])
    return claim_row(
        {
            **picked,
            "attempt": picked["attempt"] + 1,
            "lease_epoch": picked["lease_epoch"] + 1,
        }
    )


def pick(tx: _Tx, sweep_id: str, local: Local | None) -> dict[str, Any] | None:
    """The first pending run in line that can start here and whose parameters can be read
    back; one that cannot be read (text that is not a JSON object) could never run: it ends
    FAILED, with the reason logged. One whose locks a process holds here is passed over."""
    n = 1  # the one in line, locked alone (PostgreSQL); more only when it cannot start here
    while True:
        failed = False
        rows = tx.all("pick_pending", sweep_id=sweep_id, n=n)
        for row in rows:
            _, why = decode_object(row["params"])
            if why is not None or row["params"] is None:
                tx.run("fail_unreadable_run", id=row["id"])
                reason = field_error(f"run {row['id']}", "params", why or "missing (NULL)")
                logger.error("preemptible: %s; it cannot run: FAILED", reason)
                failed = True
            elif local is None or local.blocked(row["id"]) is None:
                return row
        if not failed and (n == PENDING_LOOKAHEAD or not rows):
            return None  # every run in line is blocked here, or there is none
        if not failed:
            n = PENDING_LOOKAHEAD


def target_reached(tx: _Tx, sweep_id: str, spec: Mapping[str, Any]) -> tuple[str, float] | None:
    """(run id, value) of the first run whose reported sweep metric is at or beyond the
    spec's ``metric.target`` (its latest report, as W&B reads the summary); None when there is
    no target or no run has reached it."""
    metric = _target_metric(spec)
    if metric is None:
        return None
    for r in tx.all("run_summaries", sweep_id=sweep_id):
        value = _metric(_loads(r["summary"]), metric.name)
        if metric.reached(value):
            assert value is not None
            return r["id"], value
    return None


def _target_metric(spec: Mapping[str, Any]) -> Metric | None:
    raw = spec.get("metric")
    if not isinstance(raw, Mapping) or raw.get("target") is None:
        return None
    goal: Goal = "maximize" if raw.get("goal") == "maximize" else "minimize"
    return Metric(name=str(raw.get("name")), goal=goal, target=raw["target"])


def history(tx: _Tx, sweep_id: str, spec: Mapping[str, Any]) -> list[Observation]:
    name = _metric_name(spec)
    seen = []
    for r in tx.all("history", sweep_id=sweep_id):
        params = _loads(r["params"])
        if params is None:  # unreadable: it can tell a sampler nothing (claims fail it)
            continue
        metric = _metric(_loads(r["summary"]), name)
        seen.append(Observation(params, metric, r["state"] == QueueState.FINISHED))
    return seen
