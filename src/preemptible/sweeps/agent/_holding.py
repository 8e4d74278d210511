"""An agent's hold on the run it claimed, while the run's attempt runs: the heartbeat that
renews the lease (and asks the early-termination judge, ``_early``, after each renewal), the
copy of the run's metric history into the queue, and the watchdog that stops the run when
renewals stop (``_agent``'s module docstring tells the whole lease protocol). The watchdog is a
thread of the agent, stopped with it; the attempt's guardian (``supervisor/_guard.py``), a
process of its own, reads the same ``lease.json`` and sends the lease's signals while it
fences the attempt, and the watchdog then only says so.

The lease never waits on the history. A run may report millions of points (``_metrics``);
copied in the heartbeat's thread, they delayed the renewals until the watchdog stopped the
run for a lease its own agent held (``--heartbeat 0.5 --lease 3`` and 500 metrics a step: four
times in one sweep, once with a SIGKILL during a save). So the copy has a thread and a
database connection of its own and writes one bounded slice per transaction (``_metrics``),
of at most a quarter of a heartbeat. A renewal waits for the slice under way at most: the
copy takes ``_turn`` for each slice, the heartbeat for its writes, and a renewal that waits
goes first. On SQLite the copy then leaves the file's one write lock free for
``SQLITE_YIELD``, the longest sleep of a writer waiting in SQLite's busy handler, so that the
other agents of the sweep find it free too: a copy that took the lock again at once would keep
their renewals out for its whole length, as the old final copy did. (PostgreSQL locks only
the run's row, which no other agent writes.) Slices between the renewals, in the heartbeat's
thread, were the other choice; they put the copy's time into the renewal's period and stop
the copy while the judge reads, where a thread of its own catches up at the store's rate
between renewals that come on time. Measured with ``benchmarks/bench_lease_flood.py``: the
worst gap between renewals 0.65 s at a 0.5 s heartbeat, where the old copy left 19 s (SQLite)
and 109 s (PostgreSQL) without one.

When the attempt ends the copy goes on to the end of the file while the heartbeat keeps
renewing (it only renews by then: the run is gone, so there is nothing to stop or judge), and
only then is the attempt recorded: under the claim, so that every point is stored exactly once
by the attempt that reported it and a resumed attempt's trim cannot race a late copy. What is
left then is what the copy had not caught up with, not a heartbeat's worth of file for each
heartbeat of the run.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from ..._errors import DatabaseGone, LeaseLost, PreemptibleError, StoreError
from ..._paths import HISTORY_NAME, LEASE_NAME
from ..._report import read_summary
from ..._run import read_record
from ..._states import Control
from ...checkpoint._store import CheckpointStore
from ...notices._lease import write_lease
from ...supervisor._guard import FENCE_NAME
from ...supervisor._record import RunRecord
from ..store._endings import takeover_margin
from ..store._metrics import SLICE_SECONDS, HistoryCopy
from ..store._queue import Store
from ..store._rows import Claim
from ..store._values import clean_step
from ._early import Judge, Stop, said

logger = logging.getLogger("preemptible")

MIN_LEASE_HEARTBEATS = 3.0  # a lease lasts at least this many heartbeats
WARN_AFTER_HEARTBEATS = 2.5  # a run is told to stop once this many renewals in a row are late
COPY_POLL = 0.5  # seconds between looks at a history file that has nothing new
# seconds the copy leaves SQLite's write lock free after each slice: the longest sleep of a
# writer waiting in SQLite's busy handler (100 ms), so that every waiting writer gets it
SQLITE_YIELD = 0.1


def lease_times(lease: float, heartbeat: float) -> tuple[float, float]:
    """(seconds from a renewal to the run's deadline, warning seconds before that deadline).

    The deadline is ``LEASE_MARGIN`` of the lease before the lease ends. The run is told to
    stop once ``WARN_AFTER_HEARTBEATS`` renewals in a row are missing, or half its time to the
    deadline has passed, whichever is later: a long lease rides out a long outage and still
    leaves half of it to save in. With the defaults (10 s, 60 s): 25 s after the last renewal,
    23 s before its deadline."""
    deadline = lease - takeover_margin(lease)
    tell = max(WARN_AFTER_HEARTBEATS * heartbeat, deadline / 2)
    return deadline, max(deadline - tell, 0.0)


class RunLease:
    """This agent's hold on one claimed run while its attempt runs.

    A heartbeat thread renews the lease (on a connection of its own), passes the queue's news
    (cancel, a lost lease, a deleted database) to the supervisor and rewrites ``lease.json``;
    a watchdog thread stops the run itself when the renewals stop (module docstring), so that
    a heartbeat stuck in the database's retries cannot keep a run past its lease."""

    def __init__(
        self,
        lease: float,
        heartbeat: float,
        store: Store,
        agent_id: str,
        claim: Claim,
        supervisor: Any,
        attempt_dir: Path,
        renewed_at: float,
        judge: Judge | None = None,
    ) -> None:
        self.lease, self.heartbeat, self.agent_store, self.agent_id = (
            lease,
            heartbeat,
            store,
            agent_id,
        )
        self.claim, self.supervisor = claim, supervisor
        self.attempt_dir = attempt_dir
        self.file = attempt_dir / LEASE_NAME
        self._span, self.warn = lease_times(lease, heartbeat)
        self.deadline = renewed_at + self._span  # monotonic: gone by then
        self.expired = False  # the run was stopped for its lease (not renewed, or taken over)
        self.gone: DatabaseGone | None = None
        self.judge = judge
        self.early: Stop | None = None  # the judge stopped the run (early termination)
        self._done = threading.Event()  # the heartbeat and the watchdog stop
        self._ended = threading.Event()  # the attempt ended: the copy goes to the file's end
        self._guard = threading.Lock()
        self._turn = threading.Lock()  # held by a write of the heartbeat or a copy's slice
        self._renewal = threading.Lock()  # held while a renewal waits for its turn, and in it
        self._store: Store | None = None
        self._copy_store: Store | None = None
        self._warned_file = False
        self.history = HistoryCopy(
            attempt_dir / HISTORY_NAME,
            claim.run_id,
            attempt=claim.attempt,
            epoch=claim.epoch,
            aim=min(SLICE_SECONDS, heartbeat / 4),  # a renewal may wait for one slice
        )
        self._beat = threading.Thread(target=self._beat_loop, name="preemptible-lease", daemon=True)
        self._copier = threading.Thread(
            target=self._copy_loop, name="preemptible-history", daemon=True
        )
        self._watch = threading.Thread(
            target=self._watchdog, name="preemptible-lease-watchdog", daemon=True
        )

    def write(self) -> None:
        """``lease.json`` for the run: its deadline now."""
        write_lease(
            self.file,
            run_id=self.claim.run_id,
            attempt=self.claim.attempt,
            epoch=self.claim.epoch,
            deadline=self.deadline,
            warn=self.warn,
            margin=takeover_margin(self.lease),
        )

    def start(self) -> None:
        self._store = self.agent_store.reopen()
        self._trim_history()
        self._copy_store = self.agent_store.reopen()
        self._beat.start()
        self._copier.start()
        self._watch.start()

    def stop(self) -> None:
        """Copy what is left of the attempt's history while the heartbeat still renews the
        lease (module docstring), then stop the threads: the agent records the attempt's end
        after this, while the claim still holds."""
        self._ended.set()
        if self._copier.is_alive():
            self._copier.join()
        self._done.set()
        for thread in (self._beat, self._watch):
            if thread.is_alive():
                thread.join()
        for store in (self._store, self._copy_store):
            if store is not None:
                store.close()
        self._store = self._copy_store = None

    def _trim_history(self) -> None:
        """The run's stored points after the step this attempt resumes from go: the attempt
        reports them again (``_metrics``'s docstring)."""
        assert self._store is not None
        after = newest_step(self.supervisor.resume_dir)
        try:
            self._store.trim_history(self.claim.run_id, after, epoch=self.claim.epoch)
        except PreemptibleError as exc:  # the heartbeat meets a lost lease or an outage too
            logger.warning(
                "preemptible: run %s: its metric history could not be trimmed to step %s: %s",
                self.claim.run_id,
                after,
                exc,
            )

    def _renewed(self, at: float) -> None:
        with self._guard:
            self.deadline = max(self.deadline, at + self._span)
        try:
            self.write()
        except OSError as exc:
            if not self._warned_file:
                self._warned_file = True
                logger.warning(
                    "preemptible: cannot write %s (%s); the run cannot watch its lease, only "
                    "this agent does",
                    self.file,
                    exc.strerror or exc,
                )

    def _beat_loop(self) -> None:
        store = self._store
        assert store is not None
        claim = self.claim
        summary: dict[str, Any] = {}
        marked = cancelled = False
        due = time.monotonic() + self.heartbeat  # renewals keep their period, whatever runs
        while not self._done.wait(max(due - time.monotonic(), 0.0)):
            due = max(due + self.heartbeat, time.monotonic())
            ended = self._ended.is_set()  # the run is gone: only keep the claim while copying
            try:
                with self._renewal, self._turn:
                    control = store.heartbeat(
                        claim.run_id,
                        agent=self.agent_id,
                        lease=self.lease,
                        attempt=claim.attempt,
                        epoch=claim.epoch,
                    )
                    self._renewed(store.last_try_at)
                    if ended:
                        continue
                    if not marked and read_record(self.attempt_dir).get("preempting"):
                        store.mark_preempting(claim.run_id, attempt=claim.attempt)
                        marked = True
                    latest = read_summary(self.attempt_dir)
                    if latest and latest != summary:
                        store.report(claim.run_id, latest, epoch=claim.epoch)
                        summary = latest
                if self.judge is not None and self.early is None:
                    self.early = self.judge.check(store)
                    if self.early is not None:
                        said(self.early, self.judge.metric, claim.attempt)
                        self._inject(signal.SIGTERM)  # it saves and exits as preempted
            except LeaseLost:
                self.expired = True  # ended for the lease, not for anything the run did
                logger.error(
                    "preemptible: run %s attempt %d: another agent took the run over; killing "
                    "what is left of this attempt",
                    claim.run_id,
                    claim.attempt,
                )
                self._inject(signal.SIGKILL)
                return
            except DatabaseGone as exc:  # nothing can be recorded: the run saves and stops
                self.gone = exc
                logger.error("preemptible: %s; stopping run %s", exc, claim.run_id)
                self._inject(signal.SIGTERM)
                return
            except (StoreError, OSError) as exc:  # the database is away: the watchdog acts
                logger.warning("preemptible: heartbeat of run %s failed: %s", claim.run_id, exc)
                continue
            except PreemptibleError as exc:  # a value the queue refused: keep the lease alive
                logger.warning(
                    "preemptible: heartbeat of run %s: %s; the run goes on", claim.run_id, exc
                )
                continue
            if control.control == Control.CANCELLED and (not cancelled or control.cancel_now):
                now = control.cancel_now
                logger.warning(
                    "preemptible: sweep %s cancelled%s; stopping run %s",
                    claim.sweep_id,
                    " --now" if now else "",
                    claim.run_id,
                )
                self._inject(signal.SIGKILL if now else signal.SIGTERM)
                cancelled = True
                if now:
                    return

    def _copy_loop(self) -> None:
        """Copy the history a slice at a time (on SQLite with a pause after each); look at
        the file every ``COPY_POLL`` seconds when it has nothing new; once the attempt ended,
        copy to the file's end and return (module docstring)."""
        store = self._copy_store
        assert store is not None
        history, claim = self.history, self.claim
        idle = min(COPY_POLL, self.heartbeat)
        while True:
            ended = self._ended.is_set()  # before the read: the file is whole once it is set
            try:
                moved = history.read()
                with self._renewal:
                    pass  # a renewal waiting for its turn goes first (a Lock is not fair)
                with self._turn:
                    stored = history.store(store)
            except LeaseLost:
                return  # another claim holds the run: the heartbeat says so and acts
            except DatabaseGone:
                return  # the heartbeat says so and stops the run
            except (PreemptibleError, OSError) as exc:
                if ended:
                    logger.warning(
                        "preemptible: run %s: the last of its metric history was not stored: %s",
                        claim.run_id,
                        exc,
                    )
                    return
                logger.warning(
                    "preemptible: run %s: its metric history could not be copied (%s); trying "
                    "again in %.0f s",
                    claim.run_id,
                    exc,
                    self.heartbeat,
                )
                self._ended.wait(self.heartbeat)
                continue
            if stored:
                if store.kind == "sqlite":  # the write lock free for the other agents
                    time.sleep(SQLITE_YIELD)
            elif not moved:
                if ended:
                    return  # every line of the finished attempt is stored
                self._ended.wait(idle)

    def _watchdog(self) -> None:
        """SIGTERM ``warn`` seconds before the deadline, SIGKILL at it, unless renewed. While
        the attempt's guardian fences it (``supervisor/_guard.py``: a process that runs on when
        this one is stopped), the guardian sends them and this thread only says so: both
        sending would be a second SIGTERM, which a handler takes for a hard exit."""
        termed = killed = False
        while not killed:
            with self._guard:
                deadline = self.deadline
            now = time.monotonic()
            fenced = self.supervisor.fenced
            by = "its guardian sends " if fenced else ""
            if now >= deadline:
                killed = True
                if _group_alive(self.supervisor.job_group):
                    self.expired = True
                    logger.error(
                        "preemptible: run %s: its lease was not renewed in time; %sSIGKILL, "
                        "before another agent may take the run over",
                        self.claim.run_id,
                        by,
                    )
                    if not fenced:
                        self._inject(signal.SIGKILL)
                break
            if now >= deadline - self.warn and not termed:
                termed = True
                if not _group_alive(self.supervisor.job_group) and not self.fenced():
                    continue  # it has ended (while this agent was stopped, say): nothing to stop
                self.expired = True
                logger.warning(
                    "preemptible: run %s: its lease has not been renewed for %.0f s (the "
                    "database is unreachable?); stopping the run (%sSIGTERM) to have it gone "
                    "%.0f s from now, before another agent may take it over",
                    self.claim.run_id,
                    now - (deadline - self._span),
                    by,
                    deadline - now,
                )
                if not fenced:
                    self._inject(signal.SIGTERM)
            wake = deadline if termed else deadline - self.warn
            if self._done.wait(min(max(wake - now, 0.0), 1.0)):
                return

    def fenced(self) -> bool:
        """Whether the attempt's guardian stopped it for its lease (it leaves ``fence.json``
        beside the lease file): it ended for the lease, not for anything the run did."""
        return (self.attempt_dir / FENCE_NAME).exists()

    @property
    def stopped_for_lease(self) -> bool:
        """The attempt was stopped for this agent's lease (not renewed, or taken over), by
        this agent or by the attempt's guardian."""
        return self.expired or self.fenced()

    def _inject(self, signum: int) -> None:
        self.supervisor.stop_job(signum)


def newest_step(directory: Path | str, record: RunRecord | None = None) -> int | None:
    """The step of the run's newest checkpoint; None if there is none, it cannot be read, or
    its step does not fit the queue's 64-bit column (a hand-made file name, say). In a bucket
    (``directory`` a URL), the attempt's ``record`` says: the newest upload that completed,
    else the newest commit."""
    if isinstance(directory, str):
        if record is None:
            return None
        step = record.remote_step  # resume.ckpt names no step: the newest commit's then
        step = record.resume_step if step is None else step
        return None if step is None else clean_step(step, directory)
    try:
        newest = CheckpointStore(directory, create=False).latest()
    except (OSError, ValueError, OverflowError):
        return None
    if newest is None:
        return None
    return clean_step(newest.step, str(directory))


def _group_alive(pgid: int | None) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies do not)."""
    if pgid is None:
        return False
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True  # cannot tell: act as if it ran
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False
