"""What the web page reads of a sweep of any size: its counts, the best run, the best-so-far
curve, and one page of its runs table (filtered by state).

A sweep may hold 100,000 runs and an open page asks every 2 s, so the server keeps a small
row per run between requests (index, state, attempts, last change, a finished run's metric)
and reads again only the runs written since: every write of a run sets its ``updated_at``
from the database's clock. Each read takes the runs changed since ``MARGIN`` seconds before
the newest change it saw, not since that change itself: a transaction that read the clock
before another but committed after it (PostgreSQL's clock is the transaction's start) is
still found. The first read is the whole sweep (about a second for 100,000 runs); the next
ones, the runs that moved.

What the page draws from these rows is computed again only when one of them changed
(``version``); the rows of the table page are read in full each time (``status_run``), as
the terminal table reads them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ..._errors import ConfigError
from ..._states import QueueState
from ..status._snapshot import STATES, _metric_of, _object, _run_docs, _Warnings, sweep_head
from ..store._connector import _Tx
from ..store._queue import Store

MARGIN = 120.0  # seconds: see the module docstring
PAGE_ROWS = 100  # runs per page of the table
MAX_DOTS = 2000  # finished runs drawn one by one; more: the lowest and highest of each bin
BINS = 500
MAX_STEPS = 1000  # improvements of the best-so-far line drawn one by one; more: one per bin

# (index, state, attempts, the metric of a finished run): a heartbeat, which only moves
# updated_at, changes none of it, so the page's drawing is not computed again for it
_Row = tuple[int, str, int, float | None]


@dataclass(frozen=True)
class Aggregate:
    """What the page draws from every run: computed once per ``version`` of the rows."""

    counts: dict[str, int]
    best: dict[str, Any] | None  # {"run_id", "metric", "index"}
    dots: list[tuple[int, float]]  # (run index, metric) of finished runs, binned when many
    steps: list[tuple[int, float]]  # the best-so-far line: (index, best up to it)
    finished: int  # finished runs with a metric
    binned: bool


class SweepModel:
    """The rows of one sweep, brought up to date by ``refresh`` (one thread at a time: the
    server's store lock)."""

    def __init__(self, sweep_id: str) -> None:
        self.sweep_id = sweep_id
        self.rows: dict[str, _Row] = {}
        self.order: list[str] = []  # run ids by index
        self.newest: float | None = None  # the newest updated_at seen
        self.version = 0
        self.head: dict[str, Any] = {}
        self._metric: dict[str, str] | None = None
        self._warn = _Warnings()  # one warning per unreadable field while the server runs
        self._aggregate: tuple[int, Aggregate] | None = None
        self._filtered: tuple[int, frozenset[str], list[str]] | None = None

    # -- reading ----------------------------------------------------------------------------
    def refresh(self, store: Store) -> None:
        """Read the sweep's row and the runs written since the last read (module docstring).
        ConfigError when the sweep does not exist."""
        since = -1e300 if self.newest is None else self.newest - MARGIN  # first: every run

        def read(tx: _Tx) -> tuple[Mapping[str, Any] | None, list[tuple[Any, ...]]]:
            row = tx.one("get_sweep", id=self.sweep_id)
            if row is None:
                return None, []
            return row, list(tx.iter("web_changed", sweep_id=self.sweep_id, since=since))

        # read in full first, then applied: a transaction retried half-way changes nothing
        row, changed = store.read(read)
        if row is None:
            raise ConfigError(f"no sweep {self.sweep_id!r} in {store.display}")
        self.head = sweep_head(row, self._warn)
        self._metric = self.head["metric"]
        self._apply(changed)

    def _apply(self, changed: Iterable[tuple[Any, ...]]) -> None:
        name = self._metric["name"] if self._metric else None
        added, moved = False, False
        last = self.rows[self.order[-1]][0] if self.order else -1
        for run_id, index, state, attempts, updated_at, text in changed:
            metric = None if text is None or name is None else self._value(text, run_id, name)
            if self.newest is None or updated_at > self.newest:
                self.newest = float(updated_at)
            row = (index, state, attempts, metric)
            old = self.rows.get(run_id)
            if old == row:
                continue
            if old is None:
                self.order.append(run_id)
                added = True
                moved = moved or index < last
                last = max(last, index)
            self.rows[run_id] = row
            self.version += 1
        if added and moved:
            self.order.sort(key=lambda r: self.rows[r][0])

    def _value(self, text: Any, run_id: str, name: str) -> float | None:
        """The metric of a finished run's summary: orjson first (five times faster; what it
        refuses, an infinity, the standard decoder reads as the status table does)."""
        summary: Any = None
        if type(text) is str:
            try:
                summary = orjson.loads(text)
            except orjson.JSONDecodeError:
                summary = None
        if type(summary) is not dict:
            summary = _object(text, "summary", run_id, self._warn, [])
        return _metric_of(summary, name)

    # -- what the page shows ----------------------------------------------------------------
    def aggregate(self) -> Aggregate:
        if self._aggregate is None or self._aggregate[0] != self.version:
            self._aggregate = (self.version, _aggregate(self.order, self.rows, self._metric))
        return self._aggregate[1]

    def matching(self, states: frozenset[str]) -> list[str]:
        """The ids of the runs in ``states`` (empty: every run), by index."""
        if not states:
            return self.order
        cached = self._filtered
        if cached is None or cached[0] != self.version or cached[1] != states:
            rows = self.rows
            cached = (self.version, states, [r for r in self.order if rows[r][1] in states])
            self._filtered = cached
        return cached[2]

    def page_docs(self, store: Store, ids: Sequence[str], now: float) -> list[dict[str, Any]]:
        """The run documents (``_snapshot._run_doc``) of ``ids``, read now."""
        name = self._metric["name"] if self._metric else None

        def read(tx: _Tx) -> list[dict[str, Any]]:
            return [
                doc
                for run_id in ids
                for doc in _run_docs(tx.iter("status_run", id=run_id), name, now, self._warn)
            ]

        return store.read(read)


def _aggregate(
    order: Sequence[str], rows: Mapping[str, _Row], metric: Mapping[str, str] | None
) -> Aggregate:
    counts: dict[str, int] = dict.fromkeys(STATES, 0)
    counts.update(Counter(row[1] for row in rows.values()))
    finished = QueueState.FINISHED
    values = [
        (row[0], row[3], run_id)
        for run_id in order
        if (row := rows[run_id])[3] is not None and row[1] == finished
    ]
    if metric is None or not values:
        return Aggregate(counts, None, [], [], len(values), False)
    sign = -1.0 if metric["goal"] == "maximize" else 1.0
    steps: list[tuple[int, float]] = []
    best: tuple[int, float, str] | None = None
    for index, value, run_id in values:  # by index: the best-so-far line
        if best is None or sign * value < sign * best[1]:
            best = (index, value, run_id)
            steps.append((index, value))
    assert best is not None
    lo, hi = values[0][0], values[-1][0]
    if steps[-1][0] != hi:
        steps.append((hi, steps[-1][1]))  # the line runs to the last finished run
    binned = len(values) > MAX_DOTS
    dots = _binned(values, lo, hi) if binned else [(i, v) for i, v, _ in values]
    if len(steps) > MAX_STEPS:
        steps = _thinned(steps, lo, hi)
    return Aggregate(
        counts,
        {"run_id": best[2], "metric": best[1], "index": best[0]},
        dots,
        steps,
        len(values),
        binned,
    )


def _bin(index: int, lo: int, hi: int) -> int:
    return (index - lo) * BINS // (hi - lo + 1)


def _binned(values: Sequence[tuple[int, float, str]], lo: int, hi: int) -> list[tuple[int, float]]:
    """The lowest and the highest value of each of ``BINS`` ranges of run indexes (``values``
    by index): the envelope of the cloud, whatever its size."""
    out: list[tuple[int, float]] = []
    span = hi - lo + 1
    current = -1
    low = high = (0, 0.0)
    for index, value, _ in values:
        b = (index - lo) * BINS // span
        if b != current:
            if current >= 0:
                out.extend(sorted({low, high}))
            current, low, high = b, (index, value), (index, value)
        elif value < low[1]:
            low = (index, value)
        elif value > high[1]:
            high = (index, value)
    out.extend(sorted({low, high}))
    return out


def _thinned(steps: Sequence[tuple[int, float]], lo: int, hi: int) -> list[tuple[int, float]]:
    """The best-so-far line with one point per bin (the last in each: the best up to there),
    the first and the last kept."""
    kept: dict[int, tuple[int, float]] = {}
    for point in steps:
        kept[_bin(point[0], lo, hi)] = point
    out = sorted(kept.values())
    return out if out[0] == steps[0] else [steps[0], *out]
