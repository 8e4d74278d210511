"""Each run's metric history in the sweep queue: the points its attempts reported, by step.

An attempt's training process appends its points to ``history.jsonl`` (``preemptible.report``);
the agent holding the run copies the new lines into the queue as they come (``HistoryCopy``,
driven by a thread of ``RunLease``) and to the file's end when the attempt ends, before the
attempt is recorded. Writes carry the claim's epoch, as the summary does: a holder whose lease
was taken over writes nothing more. When an attempt starts, the points after the step it
resumes from are removed (``Store.trim_history``): a later report at the same step replaces the
earlier value anyway, and the removal takes away the points the previous attempt reported after
its last checkpoint, so that the history of a stopped and resumed run is the one an
uninterrupted run would have. Hyperband and the web page read it.

A run may report far faster than any database stores: 500 metrics a step in a tight loop fill
the file's 64 MiB in seconds, four million points. The copy is therefore cut into slices, each
one transaction. A transaction holds what the lease's renewal needs (SQLite's one write lock
for the whole file; on PostgreSQL the run's row, locked by the fence), so a slice bounds how
long a renewal, or another agent's write, can wait on it. Each slice is sized by the time the
previous one took to take about ``aim`` seconds (``SLICE_SECONDS``, or a quarter of the
agent's heartbeat when that is less; ``MIN_SLICE`` to ``MAX_SLICE`` points): a slice's cost
is not in proportion to its points, since its points are spread over one index page per
metric, and backends differ. Measured on a loaded 2-core machine with 500 metrics, one
million points: SQLite stored 250,000 points a second in slices of 10,000 (40 ms each) and
340,000 in slices of 40,000 (110 ms); PostgreSQL 100,000 a second in slices of 5,000 (50 ms)
or 20,000 (200 ms), through ``add_points`` (one statement of arrays; an INSERT per point
reached half that, and SQLite's ``json_each`` in one statement was slower than an INSERT per
point). The old copy wrote 20,000 points a transaction and up to 4 MiB of file in a row.

Points are stored exactly once whatever is retried: the copy moves on in the file only past
points a committed transaction holds, and a point stored again (a retry of a transaction whose
commit was not confirmed) replaces itself.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..._errors import LeaseLost
from ..._paths import MAX_STEP
from ..._report import read_history
from ._connector import T, _Tx

logger = logging.getLogger("preemptible")

Point = tuple[int, str, float]  # (step, metric name, value)
SLICE_SECONDS = 0.2  # what one slice of the copy aims to take, at most (module docstring)
FIRST_SLICE = 5_000  # points in the first slice; the next ones are sized by how long it took
MIN_SLICE, MAX_SLICE = 500, 100_000  # points in one slice, at least (but the last) and at most


class HistoryStore:
    """The history part of ``Store`` (a mixin: ``Store`` gives the transactions)."""

    kind: str  # the backend's: "sqlite" or "postgres"

    def _transact(self, fn: Callable[[_Tx], T], *, write: bool = True) -> T:
        raise NotImplementedError

    def add_history(
        self, run_id: str, points: Sequence[Point], *, attempt: int, epoch: int
    ) -> None:
        """Store ``points`` of ``run_id`` reported by ``attempt`` (a point at a step already
        stored replaces it; of two in ``points`` the later one), in one transaction, while
        claim ``epoch`` holds the run (LeaseLost otherwise). Points whose step or value the
        queue cannot hold are left out. The caller bounds ``points`` (``HistoryCopy``)."""
        latest = {
            (step, name): value for step, name, value in points if _storable((step, name, value))
        }
        if not latest:
            return

        def store(tx: _Tx) -> None:
            _fence(tx, run_id, epoch)
            if self.kind == "postgres":  # one statement of arrays
                tx.run(
                    "add_points",
                    run_id=run_id,
                    attempt=attempt,
                    names=[name for _, name in latest],
                    steps=[step for step, _ in latest],
                    vals=list(latest.values()),
                )
            else:  # SQLite: a statement a point is as fast, in-process
                rows = [
                    {"run_id": run_id, "name": name, "step": step, "value": v, "attempt": attempt}
                    for (step, name), v in sorted(
                        latest.items(), key=lambda kv: (kv[0][1], kv[0][0])
                    )
                ]
                tx.run_many("add_point", rows)

        self._transact(store)

    def trim_history(self, run_id: str, after: int | None, *, epoch: int) -> None:
        """Remove the run's points after step ``after`` (None: all of them), while claim
        ``epoch`` holds the run."""

        def trim(tx: _Tx) -> None:
            _fence(tx, run_id, epoch)
            tx.run("trim_history", run_id=run_id, after=-1 if after is None else after)

        self._transact(trim)

    def histories(self, sweep_id: str, name: str) -> dict[str, list[tuple[int, float]]]:
        """Every run of the sweep that has points of metric ``name``: run id -> (step, value),
        ascending by step."""

        def read(tx: _Tx) -> dict[str, list[tuple[int, float]]]:
            out: dict[str, list[tuple[int, float]]] = {}
            for run_id, step, value in tx.iter("sweep_history", sweep_id=sweep_id, name=name):
                out.setdefault(run_id, []).append((int(step), float(value)))
            return out

        return self._transact(read, write=False)

    def band_values(self, sweep_id: str, name: str, bands: Sequence[int]) -> dict[int, list[float]]:
        """For each of ``bands`` (point counts): the n-th point of metric ``name`` of every
        run of the sweep that has that many, its points ascending by step (in no order of
        runs). What Hyperband's thresholds need, found through the (run, metric, step) index
        without reading the rest of the histories."""

        def read(tx: _Tx) -> dict[int, list[float]]:
            out: dict[int, list[float]] = {}
            for band in bands:  # a query a band: the n-th point is found through the index
                found = tx.iter("sweep_nth_values", sweep_id=sweep_id, name=name, offset=band - 1)
                values = [float(value) for (value,) in found]
                if values:
                    out[band] = values
            return out

        return self._transact(read, write=False) if bands else {}

    def metric_points(self, run_id: str, name: str) -> list[tuple[int, float]]:
        """The run's points of metric ``name``: (step, value), ascending by step."""

        def read(tx: _Tx) -> list[tuple[int, float]]:
            found = tx.iter("run_metric_points", run_id=run_id, name=name)
            return [(int(step), float(value)) for step, value in found]

        return self._transact(read, write=False)

    def run_history(self, run_id: str) -> dict[str, list[tuple[int, float, int]]]:
        """The run's points: metric name -> (step, value, attempt), ascending by step."""

        def read(tx: _Tx) -> dict[str, list[tuple[int, float, int]]]:
            out: dict[str, list[tuple[int, float, int]]] = {}
            for name, step, value, attempt in tx.iter("run_history", run_id=run_id):
                out.setdefault(name, []).append((int(step), float(value), int(attempt)))
            return out

        return self._transact(read, write=False)


class HistoryCopy:
    """The agent's copy of one attempt's ``history.jsonl`` into the queue, a slice at a time:
    ``read`` takes the whole lines appended since (no database), ``store`` writes the next
    slice of what was read in one transaction. ``RunLease`` calls them from a thread of its
    own and paces them."""

    def __init__(
        self,
        path: Path,
        run_id: str,
        *,
        attempt: int,
        epoch: int,
        max_slice: int = MAX_SLICE,
        aim: float = SLICE_SECONDS,
    ) -> None:
        self.path, self.run_id, self.attempt, self.epoch = path, run_id, attempt, epoch
        self.max_slice, self.aim = max_slice, aim  # points, and seconds, a slice at most
        self.slice = min(FIRST_SLICE, max_slice)  # points in the next transaction
        self.took = 0.0  # seconds the last slice's transaction took
        self.offset = 0  # of the file: the lines before it are read
        self.copied = 0  # points stored so far
        self._read: list[Point] = []  # read, not all stored yet
        self._next = 0  # the first of them not stored

    @property
    def pending(self) -> int:
        """Points read from the file and not stored yet."""
        return len(self._read) - self._next

    def read(self) -> bool:
        """Read on in the file when every point read is stored; whether it moved on (a file
        that grew by lines that hold no point moves on too)."""
        if self.pending:
            return False
        points, offset = read_history(self.path, self.offset)
        moved, self.offset = offset != self.offset, offset
        self._read, self._next = points, 0
        return moved

    def store(self, store: HistoryStore) -> int:
        """Store the next slice of the points read, in one transaction; how many (0: none
        was waiting). Raises what the store raises (LeaseLost, StoreError); what was not
        stored is stored by the next call."""
        chunk = self._read[self._next : self._next + self.slice]
        if not chunk:
            return 0
        began = time.monotonic()
        store.add_history(self.run_id, chunk, attempt=self.attempt, epoch=self.epoch)
        self.took = time.monotonic() - began
        if len(chunk) == self.slice:  # a whole slice: size the next one to take ``aim``
            scale = min(max(self.aim / max(self.took, 1e-6), 0.5), 2.0)
            self.slice = min(max(int(self.slice * scale), MIN_SLICE), self.max_slice)
        self._next += len(chunk)
        self.copied += len(chunk)
        if not self.pending:
            self._read, self._next = [], 0
        return len(chunk)


def _fence(tx: _Tx, run_id: str, epoch: int) -> None:
    if tx.run("hold_fenced", id=run_id, epoch=epoch) != 1:
        raise LeaseLost(f"run {run_id} is no longer held by claim {epoch}")


def _storable(point: Point) -> bool:
    step, name, value = point
    return 0 <= step <= MAX_STEP and bool(name) and math.isfinite(value)
