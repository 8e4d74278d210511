"""How an attempt ends and what becomes of its run: the queue's restart policy (``settle``),
a late result (``late``) and the takeover of a lease whose holder is gone (``expire``).

Run states after an attempt (``finish``), following ``preemptible run``'s restart policy:
FINISHED ends the run. PREEMPTED (and a lost lease) goes back to PENDING while the run has
been preempted at most ``max_preemptions`` times, else the run ends PREEMPTED (or CRASHED).
FAILED and CRASHED go back while the run has failed at most ``max_failures`` times (a run gets
1 + ``max_failures`` tries for failures), else it ends in that state. KILLED (a Ctrl+C the run
did not handle) ends the run. STOPPED (early termination stopped it; it saved a checkpoint)
ends the run STOPPED, with no budget spent: ``preemptible sweep resume --run`` may put it back.
In a cancelled sweep every ending but FINISHED ends it CANCELLED.
``release`` (the agent is stopping) puts the run back without touching any budget;
``abandon`` (the attempt could not even start here) undoes the claim: no attempt is counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from ..._errors import ConfigError, LeaseLost, PreemptibleError
from ..._states import Control, Ending, QueueState, spend
from ._connector import MAX_BACKOFF, _Health, _Tx
from ._watch import BeatWatch

logger = logging.getLogger("preemptible")

RELEASED = Ending.RELEASED  # the attempt's ending when a stopping agent hands its run back
LEASE_EXPIRED = "(lease expired)"  # closed_by of an attempt ended by someone else's expiry
LEASE_MARGIN = 0.2
"""The share of a lease that separates its holder's own deadline from a takeover: the holder
stops its run ``LEASE_MARGIN * lease`` before the lease runs out by its own clock, an agent on
another host takes the run over that long after it ran out by the database's clock. Covers
clock rates that drift apart by up to 20 % over one lease (NTP keeps them within 0.05 %), the
database's commit latency and the time the stopping run takes past its deadline."""


def takeover_margin(lease_seconds: float | None) -> float:
    """Seconds past a lease's end before an agent on another host may take the run over."""
    return LEASE_MARGIN * lease_seconds if lease_seconds else 0.0


def recovery_hold(lease_seconds: float | None) -> float:
    """Seconds after this process found the database reachable again during which it takes
    over no run from another host: its holder, cut off as well, gets a whole lease (and the
    longest retry backoff) to report what it did meanwhile."""
    lease = lease_seconds or 0.0
    return lease + takeover_margin(lease) + MAX_BACKOFF


class Local(Protocol):
    """What only the agent's own host can tell the store (``claim`` asks before a takeover
    or a start). ``identity``: this process as stored in ``lease_holder``."""

    identity: str

    def holder_alive(self, holder: str | None) -> bool | None:
        """Whether the process ``holder`` (a ``lease_holder``) still lives; None when it is
        not on this host (or not comparable: another boot or pid namespace)."""
        ...

    def blocked(self, run_id: str) -> str | None:
        """Why run ``run_id`` cannot start here now (a process still holds its locks), or
        None."""
        ...


def settle(
    ending: str,
    *,
    lost: bool,
    preemptions: int,
    failures: int,
    max_preemptions: int,
    max_failures: int,
    control: str,
) -> tuple[QueueState, int, int]:
    """(run state, preemptions, failures) after an attempt ended ``ending`` (module docstring).
    ``lost``: the lease expired; it counts as a preemption whatever the ending. The budgets are
    spent by the same rule as ``preemptible run``'s restarts (``_states.spend``)."""
    if ending == Ending.FINISHED:
        return QueueState.FINISHED, preemptions, failures
    if control == Control.CANCELLED or ending == Ending.CANCELLED:
        return QueueState.CANCELLED, preemptions, failures
    if ending == Ending.STOPPED:  # the sweep's decision, not the run's fault: nothing spent
        return QueueState.STOPPED, preemptions, failures
    if ending == Ending.KILLED and not lost:
        return QueueState.KILLED, preemptions, failures
    spent = spend(
        preempted=lost or ending == Ending.PREEMPTED,
        preemptions=preemptions,
        failures=failures,
        max_preemptions=max_preemptions,
        max_failures=max_failures,
    )
    state = QueueState.PENDING if spent.again else QueueState(ending)
    return state, spent.preemptions, spent.failures


def outcome(run: Mapping[str, Any], ending: str, preemptions: int) -> tuple[str, Sequence[int]]:
    if ending == RELEASED:
        state = QueueState.CANCELLED if run["control"] == Control.CANCELLED else QueueState.PENDING
        return state, (preemptions, run["failures"])
    state, *counts = settle(
        ending,
        lost=False,
        preemptions=preemptions,
        failures=run["failures"],
        max_preemptions=run["max_preemptions"],
        max_failures=run["max_failures"],
        control=run["control"],
    )
    return state, counts


def settle_run(
    tx: _Tx, run_id: str, attempt: int, state: str, counts: Sequence[int], summary: Any
) -> bool:
    preemptions, failures = counts
    changed = tx.run(
        "settle_run",
        id=run_id,
        attempt=attempt,
        state=state,
        preemptions=preemptions,
        failures=failures,
        summary=summary,
    )
    return changed == 1


def lease_lost(tx: _Tx, run_id: str, agent: str, attempt: int, display: str) -> PreemptibleError:
    """Why agent ``agent``'s attempt ``attempt`` of run ``run_id`` is no longer its own."""
    row = tx.one("get_run", id=run_id)
    if row is None:
        return ConfigError(f"no run {run_id!r} in {display}")
    return LeaseLost(
        f"run {run_id} attempt {attempt} is no longer held by agent {agent!r}: the run is "
        f"{row['state']} at attempt {row['attempt']} (its lease expired?)"
    )


def late(
    tx: _Tx,
    run: Mapping[str, Any],
    agent: str,
    attempt: int,
    ending: str,
    values: dict[str, Any],
    display: str,
) -> str:
    """The holder's own result for an attempt that another agent ended as lost (its lease
    had run out) when no other attempt has started since: it replaces the lost ending.
    The takeover counted a preemption (unless it cancelled the run): taken back."""
    run_id = run["id"]
    taken_back = run["attempt_outcome"] != QueueState.CANCELLED
    preemptions = run["preemptions"] - taken_back
    state, counts = outcome(run, ending, max(preemptions, 0))
    changed = tx.run(
        "resettle_run",
        id=run_id,
        attempt=attempt,
        was=run["state"],
        state=state,
        preemptions=counts[0],
        failures=counts[1],
        summary=values["summary"],
    )
    if changed != 1:
        raise lease_lost(tx, run_id, agent, attempt, display)
    tx.run(
        "reclose_attempt",
        run_id=run_id,
        number=attempt,
        ending=ending,
        outcome=state,
        closed_by=agent,
        expired=LEASE_EXPIRED,
        **values,
    )
    logger.warning(
        "preemptible: run %s attempt %d: its result (%s) came after its lease had run out; "
        "no other attempt had started, so it is kept: the run is %s",
        run_id,
        attempt,
        ending,
        state,
    )
    return state


def resume_stopped(tx: _Tx, sweep_id: str, run_id: str, display: str) -> None:
    """``Store.resume_stopped``'s transaction."""
    if tx.run("resume_stopped", id=run_id, sweep_id=sweep_id) == 1:
        return
    row = tx.one("get_run", id=run_id)
    if row is None or row["sweep_id"] != sweep_id:
        raise ConfigError(f"no run {run_id!r} in sweep {sweep_id!r} ({display})")
    if tx.retry and row["state"] == QueueState.PENDING and row["early_exempt"]:
        return  # an earlier try did it, its acknowledgement lost
    raise ConfigError(
        f"run {run_id} is {row['state']}, not {QueueState.STOPPED}: only a run that early "
        "termination stopped can be resumed with --run"
    )


def gone(r: Mapping[str, Any], local: Local | None, health: _Health) -> bool:
    """Whether the holder of expired lease ``r`` is provably gone (``_queue``'s docstring).
    ``r["overdue"]``: seconds since the lease ran out, by one clock (PostgreSQL's, or this
    agent's own over the renewal counter: ``_watch``); ``r["alive"]``: the holder's process,
    as this host can tell (None: not on this host, or not comparable)."""
    alive = r["alive"]
    if alive is not None:  # the holder's own host: its process and the run's locks say
        return not alive and local is not None and local.blocked(r["id"]) is None
    if r["overdue"] <= takeover_margin(r["lease_seconds"]):
        return False
    recovered = health.recovered_at
    hold = recovery_hold(r["lease_seconds"])
    return recovered is None or time.monotonic() - recovered >= hold


def expired_leases(
    tx: _Tx, local: Local | None, watch: BeatWatch | None
) -> Iterator[dict[str, Any]]:
    """The running runs whose lease ran out, with ``overdue`` and ``alive`` (``gone``). On
    PostgreSQL the query picks them by the server's clock; on SQLite (``watch``) every running
    run comes, and a lease ran out once this agent saw its renewal counter stay the same for
    the lease (``_watch``), or, on the holder's own host, by the wall clock (its liveness
    decides there, not the time)."""
    rows = tx.all("expired_runs")
    if watch is not None:
        watch.keep(r["id"] for r in rows)
    for row in rows:
        r = dict(row)
        if watch is not None:
            still = watch.unchanged_for(r["id"], r["lease_epoch"], r["lease_beats"])
            r["overdue"] = still - (r["lease_seconds"] or 0.0)
            wall = r["wall_overdue"]
            if r["overdue"] <= 0 and (wall is None or wall <= 0):
                continue
        # asked only of leases that ran out: it says why this agent waits, when it does
        r["alive"] = local.holder_alive(r["lease_holder"]) if local is not None else None
        if watch is not None and r["overdue"] <= 0 and r["alive"] is None:
            continue  # only the wall clock says so, and the holder is not on this host
        yield r


def expire(
    tx: _Tx, local: Local | None, health: _Health, watch: BeatWatch | None = None
) -> list[str]:
    """Take over every run whose lease ran out and whose holder is gone; their ids.
    ``watch``: on SQLite, this agent's record of renewals (``_watch``)."""
    expired = []
    for r in expired_leases(tx, local, watch):
        if not gone(r, local, health):
            continue
        ending = Ending.PREEMPTED if r["marked_preempting"] else Ending.CRASHED
        state, *counts = settle(
            ending,
            lost=True,
            preemptions=r["preemptions"],
            failures=r["failures"],
            max_preemptions=r["max_preemptions"],
            max_failures=r["max_failures"],
            control=r["control"],
        )
        if settle_run(tx, r["id"], r["attempt"], state, counts, None):
            tx.run(
                "close_attempt",
                run_id=r["id"],
                number=r["attempt"],
                ending=ending,
                exit_code=None,
                duration=None,
                checkpoint_step=None,
                marked=0,
                outcome=state,
                closed_by=LEASE_EXPIRED,
            )
            expired.append(r["id"])
            logger.warning(
                "preemptible: run %s lost its agent (lease expired %.1f s ago at attempt "
                "%d, its holder gone): %s",
                r["id"],
                r["overdue"],
                r["attempt"],
                state,
            )
    return expired
