"""A real SQLite sweep queue on a clock the test sets: fixtures ``sweep_clock`` (stands in for the
``time`` module of the SQLite backend and of the agent's lease watch) and ``sweep_store`` (an
empty queue on that clock), and ``SPEC``, a small random sweep minimising ``loss``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from preemptible.sweeps.store import _sqlite, _watch
from preemptible.sweeps.store._queue import Store, open_store
from preemptible.sweeps.store._rows import AttemptRow

SPEC: dict[str, Any] = {
    "method": "random",
    "metric": {"name": "loss", "goal": "minimize"},
    "parameters": {"lr": {"min": 0.001, "max": 0.1}},
}


class Clock:
    """Stands in for the ``time`` module of the SQLite backend: its ``time()`` is the
    database clock; and of the agent's watch of the leases (``_watch``): ``monotonic()``."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    monotonic = time


@pytest.fixture
def sweep_clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock(1000.0)
    monkeypatch.setattr(_sqlite, "time", fake)
    monkeypatch.setattr(_watch, "time", fake)
    return fake


@pytest.fixture
def sweep_store(tmp_path: Path, sweep_clock: Clock) -> Iterator[Store]:
    s = open_store(f"sqlite:///{tmp_path / 'db' / 'sweeps.db'}", retry_timeout=10)
    yield s
    s.close()


def attempt_row(number: int, ending: str | None, step: int | None) -> AttemptRow:
    """Attempt ``number`` of run ``r``, ended by ``ending`` with its checkpoint at ``step``."""
    return AttemptRow("r", number, "a", "h", 0.0, None, ending, None, None, step, False, None, None)
