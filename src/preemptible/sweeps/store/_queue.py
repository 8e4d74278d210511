"""The sweep queue: sweeps, their runs and every attempt, in SQLite or PostgreSQL.

Agents on one machine or many share one database. The guarantees:

* A (run, attempt) is handed to exactly one agent. A claim is one transaction (SQLite:
  ``BEGIN IMMEDIATE``; PostgreSQL: ``FOR UPDATE SKIP LOCKED``, and the sweep row locked only
  to create a new run), and it carries a client token: a claim retried because its commit's
  acknowledgement was lost finds the run it already took instead of taking a second one.
* An agent holds its run by a lease, renewed by ``heartbeat``: on PostgreSQL by the server's
  clock; on SQLite, which has no clock that all processes share, by a renewal counter that
  each agent watches on its own monotonic clock (``_watch``), never by comparing wall clocks. Every
  claim increases the run's lease epoch, a fencing token: the holder's heartbeats, results,
  reports and hand-backs carry it and are refused once another claim moved it on.
* A lease that ran out is taken over (the attempt ends CRASHED, PREEMPTED if the run had marked
  itself preempting; the run goes back once, counted as a preemption) only when its holder is
  provably gone: on the holder's own host when its process is dead and no process holds the
  run's locks there (``Local``); from another host ``LEASE_MARGIN`` of the lease after it ran
  out (by the server's clock, or on SQLite by the taker's own over the renewal counter), and
  not within a lease of this process's own wait for an unreachable database (the holder may
  have a result to report). A holder it cannot see is never taken for gone. The holder's side
  stops its run by its own clock that margin *before* the lease runs out, from a process that
  runs on while the agent is stopped (the attempt's guardian, ``supervisor/_guard.py``; and
  the program itself when it watches ``preemptible.notices._lease``). Until then the run is
  left as it is: waiting is not a failure.
* A result that arrives after the lease ran out is kept when no other attempt has started:
  the attempt ends as it really ended, not as lost. Once another attempt has started, the late
  result still goes on its own attempt (its ending and exit code, marked ``late``), and the run
  stays with its new holder.
* Every call is retried with exponential backoff (capped at 5 s) while the database is locked,
  restarting or unreachable, up to a deadline (``PREEMPTIBLE_DB_RETRY_TIMEOUT``, default 300 s);
  each is idempotent, so a retry after a lost acknowledgement changes nothing twice.
* The URL's password is never shown: every message uses ``redact_url`` (which hides all
  between ``://`` and the last ``@`` but a plain user name, and all after a ``password=``-like
  parameter), and a driver's message is scrubbed of the URL and of every whole secret in it
  (``_redact``).
* One run's bad value never stops the sweep: a reported metric that is not a finite number
  (``clean_summary``) or a checkpoint step beyond 64 bits (``clean_step``) is dropped with a
  warning, and a value stored before is read back as missing. A JSON field that cannot be
  read back (``_fields``: text that is not JSON, written by hand or by another tool) is read
  as missing and named in the row's ``unreadable``; a pending run whose parameters cannot be
  read is FAILED when it would be claimed; only an unreadable spec stops its sweep's agents.
* ``open_store(reader=True)`` (``status``) reads a database it may not write (a read-only
  file system or role, a standby) without migrating it, when its schema is current.

How an attempt's ending settles its run (the restart policy) is ``_endings``'s docstring.
``Store``'s reads are ``_reads``'s (``ReadStore``), creating and steering sweeps
``_control``'s (``ControlStore``), the metric history ``_metrics``'s (``HistoryStore``):
mixins, to which this module's ``Store`` gives the transactions.

One ``Store`` is one connection: one thread at a time may use it (give each concurrent thread
or process its own).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..._env import env_str
from ..._errors import ConfigError, LeaseLost, PreemptibleError
from ..._states import Ending, QueueState
from ._backend import Backend
from ._claims import Propose, take
from ._connector import Connector, T, _Health, _Tx, choose_backend, retry_timeout_of
from ._control import ControlStore
from ._endings import (
    LEASE_EXPIRED,
    RELEASED,
    Local,
    expire,
    late,
    lease_lost,
    outcome,
    resume_stopped,
    settle_run,
)
from ._metrics import HistoryStore
from ._rows import Claim, Orders
from ._schema import _load_queries, migrate
from ._values import (
    _check_seconds,
    _json,
    clean_step,
    clean_summary,
)
from ._watch import BeatWatch

logger = logging.getLogger("preemptible")

ENDINGS = tuple(e.value for e in Ending if e is not Ending.RELEASED)  # what an attempt reports


def open_store(
    url: str | None = None,
    *,
    root: Path | None = None,
    retry_timeout: float | None = None,
    reader: bool = False,
    create: bool = True,
) -> Store:
    """Open (and create or migrate) the sweep database. ``url`` None: ``$PREEMPTIBLE_DB``, else
    ``<root or cwd>/.preemptible/sweeps.db``. ``retry_timeout``: seconds each operation keeps
    retrying a database that is unreachable, locked, or out of space, memory or connection
    slots (``$PREEMPTIBLE_DB_RETRY_TIMEOUT``, 300).
    ``reader``: the caller only reads (``status``): a database it cannot write (a read-only
    file system or role, a PostgreSQL standby) is read as it is when its schema is current.
    ``create=False`` (and any reader): an SQLite file that does not exist is an error
    (``DatabaseGone``), not a new empty queue: agents, ``status`` and the sweep controls only
    use a queue that exists."""
    if not url:
        url = env_str("PREEMPTIBLE_DB")
    retry_timeout = retry_timeout_of(retry_timeout)
    base = root if root is not None else Path.cwd()
    backend = choose_backend(url, base, reader=reader, create=create)
    return Store(backend, retry_timeout=retry_timeout, reader=reader)


# -- the store --------------------------------------------------------------------------------
class Store(HistoryStore, ControlStore):
    """The sweep queue in one database (``open_store``). Methods are transactions, retried."""

    def __init__(
        self,
        backend: Backend,
        *,
        retry_timeout: float,
        reader: bool = False,
        health: _Health | None = None,
    ) -> None:
        queries = {k: backend.convert(v) for k, v in _load_queries(backend.kind).items()}
        self._db = Connector(
            backend,
            queries,
            retry_timeout=retry_timeout,
            health=health if health is not None else _Health(),
        )
        self._backend = backend
        self._health = self._db.health
        self.kind = backend.kind
        # SQLite has no clock all agents share: leases are judged by their renewals (_watch)
        self._watch = BeatWatch() if backend.kind == "sqlite" else None
        self.display = backend.display  # the URL with its password hidden
        try:
            migrate(self._db, reader=reader)
        except BaseException:
            self.close()
            raise

    @property
    def last_try_at(self) -> float:
        """Monotonic time at which the last successful try of an operation began: before the
        database's clock read its "now", so a lease it set cannot end sooner than this + lease."""
        return self._db.last_try_at

    def reopen(self, *, retry_timeout: float | None = None) -> Store:
        """Another connection to the same database (for another thread): the same file (an
        SQLite file replaced since is refused, a deleted one not recreated) and the same
        record of outages."""
        timeout = self._db.retry_timeout if retry_timeout is None else retry_timeout
        return Store(self._backend, retry_timeout=timeout, health=self._health)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._db.close()

    def _transact(self, fn: Callable[[_Tx], T], *, write: bool = True) -> T:
        return self._db.transact(fn, write=write)

    # -- runs -------------------------------------------------------------------------------
    def claim(
        self,
        sweep_id: str,
        *,
        agent: str,
        host: str,
        lease: float,
        propose: Propose | None,
        local: Local | None = None,
    ) -> Claim | None:
        """Take the next run for ``agent``: the oldest pending one (runs that ran before
        first) that can start here, else a new one with ``propose(history, index)``'s
        parameters while the sweep is under its run cap. None when the sweep is not running or
        there is nothing to take. Expired leases whose holders are gone are taken over first
        (``expire_leases``). ``local``: what this host can tell about holders and locks; None
        takes every holder for one on another host and every pending run as free to start."""
        _check_seconds("lease", lease)
        token = secrets.token_hex(8)
        holder = local.identity if local is not None else None

        return self._transact(
            lambda tx: take(
                tx,
                sweep_id,
                agent=agent,
                host=host,
                lease=lease,
                token=token,
                holder=holder,
                propose=propose,
                local=local,
                health=self._health,
                display=self.display,
                watch=self._watch,
            )
        )

    def heartbeat(
        self, run_id: str, *, agent: str, lease: float, attempt: int, epoch: int | None = None
    ) -> Orders:
        """Extend the lease by ``lease`` seconds from now (database clock); the sweep's control,
        so that the agent sees a stop, pause or cancel within one heartbeat. Raises LeaseLost
        when the run is no longer this agent's claim ``epoch`` (another agent took it over); a
        lease that ran out but that nobody has taken over is simply renewed. ``last_try_at``
        tells when (monotonic) the renewing try began: the lease lasts at least that + lease."""
        _check_seconds("lease", lease)
        fence = -1 if epoch is None else epoch

        def beat(tx: _Tx) -> Orders:
            renewed = tx.run(
                "heartbeat", id=run_id, agent=agent, lease=lease, attempt=attempt, epoch=fence
            )
            if renewed != 1:
                raise self._lease_lost(tx, run_id, agent, attempt)
            row = tx.one("control_of_run", id=run_id)
            assert row is not None
            return Orders(row["control"], bool(row["cancel_now"]))

        return self._transact(beat)

    def finish(
        self,
        run_id: str,
        *,
        agent: str,
        attempt: int,
        ending: str,
        exit_code: int | None,
        duration: float,
        checkpoint_step: int | None,
        summary: Mapping[str, Any] | None,
        marked_preempting: bool = False,
        epoch: int | None = None,
    ) -> str:
        """Record how this agent's attempt ended; the run's new state (module docstring).
        Calling it again for the same attempt changes nothing and returns the same state. A
        result that comes after another agent ended the attempt for its expired lease is
        recorded instead of that ending while no other attempt has started; once another has,
        it is recorded on its attempt only, marked late (the run stays the new attempt's), and
        LeaseLost is raised."""
        if ending not in ENDINGS:
            raise ConfigError(f"ending={ending!r} is not valid; use one of {', '.join(ENDINGS)}")
        summary_text = (
            None if summary is None else _json(clean_summary(summary, run_id), "the run summary")
        )
        checkpoint_step = clean_step(checkpoint_step, f"run {run_id}")
        return self._close(
            run_id,
            agent=agent,
            attempt=attempt,
            epoch=epoch,
            ending=ending,
            values={
                "exit_code": exit_code,
                "duration": float(duration),
                "checkpoint_step": checkpoint_step,
                "marked": int(bool(marked_preempting)),
                "summary": summary_text,
            },
        )

    def release(self, run_id: str, *, agent: str, attempt: int, epoch: int | None = None) -> None:
        """Hand the run back (the agent is stopping): PENDING again, first in line, with the
        same id, parameters and checkpoint directory; no budget is used."""
        self._close(
            run_id,
            agent=agent,
            attempt=attempt,
            epoch=epoch,
            ending=RELEASED,
            values={
                "exit_code": None,
                "duration": None,
                "checkpoint_step": None,
                "marked": 0,
                "summary": None,
            },
        )

    def abandon(self, run_id: str, *, agent: str, attempt: int, epoch: int) -> None:
        """Undo this agent's claim of a run whose attempt never started (its program is not
        there, its directory cannot be made on this machine, a process still holds it here):
        PENDING again in its old place in the queue, no attempt counted, no budget used. The
        epoch is not given back, so nothing that claim's holder might still send is taken."""

        def undo(tx: _Tx) -> None:
            if tx.run("abandon_run", id=run_id, attempt=attempt, agent=agent, epoch=epoch) != 1:
                if tx.retry:
                    row = tx.one("get_run", id=run_id)
                    if (
                        row is not None
                        and row["lease_epoch"] == epoch
                        and row["state"] != QueueState.RUNNING
                    ):
                        return  # an earlier try did it, its acknowledgement lost
                raise self._lease_lost(tx, run_id, agent, attempt)
            tx.run("delete_attempt", run_id=run_id, number=attempt)

        self._transact(undo)

    def _close(
        self,
        run_id: str,
        *,
        agent: str,
        attempt: int,
        epoch: int | None,
        ending: str,
        values: dict[str, Any],
    ) -> str:
        def close(tx: _Tx) -> str | PreemptibleError:
            run = tx.one("lock_run", id=run_id, attempt=attempt)
            if run is None:
                raise self._no_run(run_id)
            stale = epoch is not None and run["attempt_epoch"] not in (None, epoch)
            if run["attempt_ended_at"] is not None:
                if run["attempt_closed_by"] == agent and not stale:  # a retry of this same call
                    if run["attempt_late"] and run["attempt"] != attempt:
                        return self._lease_lost(tx, run_id, agent, attempt)
                    return str(run["attempt_outcome"])
                if run["attempt_closed_by"] == LEASE_EXPIRED and not stale:
                    if run["attempt"] == attempt and run["state"] != QueueState.RUNNING:
                        return late(tx, run, agent, attempt, ending, values, self.display)
                    if ending == RELEASED:  # handed back unrun: nothing to say of the attempt
                        raise self._lease_lost(tx, run_id, agent, attempt)
                    # another attempt has started: the run is its own; this one's row says
                    # how it really ended (committed; the caller still gets LeaseLost)
                    tx.run(
                        "late_attempt",
                        run_id=run_id,
                        number=attempt,
                        ending=ending,
                        closed_by=agent,
                        expired=LEASE_EXPIRED,
                        **values,
                    )
                    return self._lease_lost(tx, run_id, agent, attempt)
                raise self._lease_lost(tx, run_id, agent, attempt)
            if run["state"] != QueueState.RUNNING or run["attempt"] != attempt:
                raise self._lease_lost(tx, run_id, agent, attempt)
            if run["lease_owner"] != agent or (epoch is not None and run["lease_epoch"] != epoch):
                raise self._lease_lost(tx, run_id, agent, attempt)
            state, counts = outcome(run, ending, run["preemptions"])
            settle_run(tx, run_id, attempt, state, counts, values["summary"])
            tx.run(
                "close_attempt",
                run_id=run_id,
                number=attempt,
                ending=ending,
                outcome=state,
                closed_by=agent,
                **values,
            )
            return state

        done = self._transact(close)
        if isinstance(done, PreemptibleError):
            raise done
        return done

    def _lease_lost(self, tx: _Tx, run_id: str, agent: str, attempt: int) -> PreemptibleError:
        return lease_lost(tx, run_id, agent, attempt, self.display)

    def resume_stopped(self, sweep_id: str, run_id: str) -> None:
        """Put run ``run_id``, which early termination stopped, back in the queue: PENDING,
        first in line, with its id and checkpoint directory (the next agent resumes it from
        its newest checkpoint); exempt from early termination from now on (``_early``).
        ConfigError for an unknown run or one that is not STOPPED."""
        self._transact(lambda tx: resume_stopped(tx, sweep_id, run_id, self.display))

    def expire_leases(self, *, local: Local | None = None) -> list[str]:
        """Take over every run whose lease ran out and whose holder is gone (module docstring;
        ``local`` as for ``claim``): end its attempt and requeue it. The ids of those runs.
        Concurrent callers never both deal with the same run."""
        return self._transact(lambda tx: expire(tx, local, self._health, self._watch))

    def mark_preempting(self, run_id: str, *, attempt: int) -> None:
        """The run declared itself preempting: a lost lease then ends the attempt PREEMPTED."""

        def mark(tx: _Tx) -> None:
            if tx.run("mark_preempting", run_id=run_id, number=attempt) != 1:
                raise ConfigError(f"no attempt {attempt} of run {run_id!r} in {self.display}")

        self._transact(mark)

    def report(self, run_id: str, summary: Mapping[str, Any], *, epoch: int | None = None) -> None:
        """The run's latest metrics (replacing the previous summary); values that cannot be
        stored as they are (``clean_summary``) are left out with a warning. With ``epoch``,
        only while that claim holds the run (LeaseLost otherwise)."""
        text = _json(clean_summary(summary, run_id), "the run summary")

        def store(tx: _Tx) -> None:
            if epoch is None:
                if tx.run("report", id=run_id, summary=text) != 1:
                    raise self._no_run(run_id)
            elif tx.run("report_fenced", id=run_id, summary=text, epoch=epoch) != 1:
                raise LeaseLost(f"run {run_id} is no longer held by claim {epoch}")

        self._transact(store)
