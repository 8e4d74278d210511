"""Each run's metric history in the sweep queue: the points its attempts reported, by step.

An attempt's training process appends its points to ``history.jsonl`` (``preemptible.report``);
the agent holding the run copies the new lines into the queue at every heartbeat and once more
when the attempt ends (``HistoryCopy``). Writes carry the claim's epoch, as the summary does: a
holder whose lease was taken over writes nothing more. When an attempt starts, the points after
the step it resumes from are removed (``Store.trim_history``): a later report at the same step
replaces the earlier value anyway, and the removal takes away the points the previous attempt
reported after its last checkpoint, so that the history of a stopped and resumed run is the one
an uninterrupted run would have. Hyperband and the web page read it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from ..._errors import LeaseLost
from ..._paths import MAX_STEP
from ..._report import read_history
from ._connector import T, _Tx

logger = logging.getLogger("preemptible")

Point = tuple[int, str, float]  # (step, metric name, value)
MAX_POINTS_PER_CALL = 20_000  # points written by one call at most (the rest wait for the next)


class HistoryStore:
    """The history part of ``Store`` (a mixin: ``Store`` gives the transactions)."""

    def _transact(self, fn: Callable[[_Tx], T], *, write: bool = True) -> T:
        raise NotImplementedError

    def add_history(
        self, run_id: str, points: Sequence[Point], *, attempt: int, epoch: int
    ) -> None:
        """Store ``points`` of ``run_id`` reported by ``attempt`` (a point at a step already
        stored replaces it), while claim ``epoch`` holds the run (LeaseLost otherwise).
        Points whose step or value the queue cannot hold are left out."""
        clean = [p for p in points if _storable(p)]

        def store(tx: _Tx) -> None:
            _fence(tx, run_id, epoch)
            for step, name, value in clean:
                tx.run(
                    "add_point", run_id=run_id, name=name, step=step, value=value, attempt=attempt
                )

        if clean:
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
    """The agent's copy of one attempt's ``history.jsonl`` into the queue: ``copy`` takes what
    was appended since the last call (whole lines only)."""

    def __init__(self, path: Path, run_id: str, *, attempt: int, epoch: int) -> None:
        self.path, self.run_id, self.attempt, self.epoch = path, run_id, attempt, epoch
        self.offset = 0

    def copy(self, store: HistoryStore, *, until_end: bool = False) -> int:
        """Copy the new points; with ``until_end``, read on until the file has no more. The
        number of points copied. Raises what the store raises (LeaseLost, StoreError)."""
        copied = 0
        while True:
            points, offset = read_history(self.path, self.offset)
            for start in range(0, len(points), MAX_POINTS_PER_CALL):
                chunk = points[start : start + MAX_POINTS_PER_CALL]
                store.add_history(self.run_id, chunk, attempt=self.attempt, epoch=self.epoch)
            copied += len(points)
            moved, self.offset = offset != self.offset, offset
            if not (until_end and moved):
                return copied


def _fence(tx: _Tx, run_id: str, epoch: int) -> None:
    if tx.run("hold_fenced", id=run_id, epoch=epoch) != 1:
        raise LeaseLost(f"run {run_id} is no longer held by claim {epoch}")


def _storable(point: Point) -> bool:
    step, name, value = point
    return 0 <= step <= MAX_STEP and bool(name) and math.isfinite(value)
