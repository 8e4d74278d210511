"""The agent's copy of an attempt's ``history.jsonl`` into the queue (``HistoryCopy``): one
bounded slice per transaction, so that the lease's renewal never waits on more than one,
catching up slice by slice; every point stored once, a later report at a step replacing it,
and a line still being written left for the next read. A real SQLite store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from preemptible.sweeps.store import _metrics
from preemptible.sweeps.store._metrics import MIN_SLICE, HistoryCopy
from preemptible.sweeps.store._queue import Store, open_store

METRICS = 50


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with open_store(f"sqlite://{tmp_path}/sweeps.db") as opened:
        yield opened


def held_run(store: Store) -> tuple[str, int]:
    spec = {"program": "t.py", "method": "grid", "parameters": {"x": {"values": [1]}}}
    sweep = store.create_sweep(spec, name=None, run_cap=None, max_failures=0, max_preemptions=0)
    store.add_runs(sweep, [{"x": 1}])
    claim = store.claim(sweep, agent="a", host="h", lease=60, propose=None)
    assert claim is not None
    return claim.run_id, claim.epoch


def lines(steps: range, shift: float = 0.0) -> str:
    return "".join(
        json.dumps({"step": s, "values": {f"m{i}": s + i / 100 + shift for i in range(METRICS)}})
        + "\n"
        for s in steps
    )


def stored(store: Store, run_id: str) -> dict[tuple[int, str], float]:
    return {
        (step, name): value
        for name, points in store.run_history(run_id).items()
        for step, value, _ in points
    }


def test_the_copy_stores_one_bounded_slice_per_transaction_and_catches_up(
    store: Store, tmp_path: Path
) -> None:
    run_id, epoch = held_run(store)
    path = tmp_path / "history.jsonl"
    path.write_text(lines(range(100)))  # 5,000 points
    copy = HistoryCopy(path, run_id, attempt=1, epoch=epoch, max_slice=MIN_SLICE)
    assert copy.read() and copy.pending == 100 * METRICS
    counts = []
    while copy.pending:
        counts.append(copy.store(store))
        assert len(stored(store, run_id)) == sum(counts)  # each slice committed on its own
    assert counts == [MIN_SLICE] * 10  # one slice a call, never more
    assert copy.store(store) == 0 and not copy.read()  # caught up: nothing new
    # more lines, one of them a step reported again, and a last line still being written
    with path.open("a") as fh:
        fh.write(lines(range(99, 120), shift=0.5) + '{"step": 120, "values": {"m0"')
    while copy.read() or copy.pending:
        assert copy.store(store) <= MIN_SLICE
    points = stored(store, run_id)
    assert len(points) == 120 * METRICS and copy.copied == 121 * METRICS
    assert points[(3, "m7")] == 3.07 and points[(99, "m7")] == 99.57  # replaced by the later
    with path.open("a") as fh:
        fh.write(": 1.5}}\n")  # the line is whole now
    assert copy.read() and copy.store(store) == 1
    assert stored(store, run_id)[(120, "m0")] == 1.5


@pytest.mark.parametrize(
    ("aim", "sizes"), [(10.0, [1000, 2000, 4000, 5000, 5000]), (0.0, [4000, 2000, 1000, 500, 500])]
)
def test_a_slice_is_sized_by_the_time_the_last_one_took(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aim: float, sizes: list[int]
) -> None:
    """Slices that take less than ``aim`` grow (twice at most, to ``max_slice``), longer
    ones shrink (by half at most, to ``MIN_SLICE``)."""
    monkeypatch.setattr(_metrics, "FIRST_SLICE", sizes[0])
    run_id, epoch = held_run(store)
    path = tmp_path / "history.jsonl"
    path.write_text(lines(range(sum(sizes) // METRICS)))
    copy = HistoryCopy(path, run_id, attempt=1, epoch=epoch, max_slice=5_000, aim=aim)
    copy.read()
    got = []
    while copy.pending:
        got.append(copy.store(store))
    assert got == sizes
    assert len(stored(store, run_id)) == sum(sizes)
