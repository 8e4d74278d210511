"""The read-only part of the sweep queue: sweeps, runs, attempts and what the samplers see.

``ReadStore`` is a mixin of ``Store`` (``_queue``), which gives the transactions; nothing here
changes the database. It also holds the "no such sweep / run" errors the other parts raise.
"""

from __future__ import annotations

from collections.abc import Callable

from ..._errors import ConfigError
from ..spec._sample import Observation
from ._claims import history, sweep_of, target_reached
from ._connector import T, _Tx
from ._rows import AttemptRow, RunRow, SweepRow, from_row, run_row, sweep_row


class ReadStore:
    """The reading part of ``Store`` (a mixin: ``Store`` gives the transactions)."""

    display: str  # the database's URL with its password hidden (``Store`` sets it)

    def _transact(self, fn: Callable[[_Tx], T], *, write: bool = True) -> T:
        raise NotImplementedError

    def schema_versions(self) -> list[int]:
        return self._transact(lambda tx: [r["version"] for r in tx.all("schema_versions")])

    def sweep(self, sweep_id: str) -> SweepRow:
        return self._transact(lambda tx: self._sweep(tx, sweep_id), write=False)

    def sweeps(self) -> list[SweepRow]:
        return self._transact(
            lambda tx: [sweep_row(r, strict=False) for r in tx.all("list_sweeps")],
            write=False,
        )

    def _sweep(self, tx: _Tx, sweep_id: str) -> SweepRow:
        return sweep_of(tx, sweep_id, self.display)

    def _no_sweep(self, sweep_id: str) -> ConfigError:
        return ConfigError(f"no sweep {sweep_id!r} in {self.display}")

    def _no_run(self, run_id: str) -> ConfigError:
        return ConfigError(f"no run {run_id!r} in {self.display}")

    def read(self, fn: Callable[[_Tx], T]) -> T:
        """``fn`` in one read transaction, retried as every call is: until it returns, ``fn``
        must do nothing it cannot do twice (``status`` writes its output only after, or
        refuses to go on once it has started writing)."""
        return self._transact(fn, write=False)

    def runs(self, sweep_id: str) -> list[RunRow]:
        def read(tx: _Tx) -> list[RunRow]:
            self._sweep(tx, sweep_id)
            return [run_row(r) for r in tx.all("list_runs", sweep_id=sweep_id)]

        return self._transact(read, write=False)

    def run(self, run_id: str) -> RunRow:
        def read(tx: _Tx) -> RunRow:
            row = tx.one("get_run", id=run_id)
            if row is None:
                raise self._no_run(run_id)
            return run_row(row)

        return self._transact(read, write=False)

    def attempts(self, run_id: str) -> list[AttemptRow]:
        rows = self._transact(lambda tx: tx.all("list_attempts", run_id=run_id), write=False)
        return [from_row(AttemptRow, r) for r in rows]

    def target_reached(self, sweep_id: str) -> tuple[str, float] | None:
        """(run id, value) of the first run that reached the sweep's ``metric.target``."""

        def read(tx: _Tx) -> tuple[str, float] | None:
            return target_reached(tx, sweep_id, self._sweep(tx, sweep_id).spec)

        return self._transact(read, write=False)

    def history(self, sweep_id: str) -> list[Observation]:
        """Every run of the sweep in creation order, as the samplers see it: its parameters,
        the sweep metric it last reported (the summary value named by the spec's
        ``metric.name``; None if missing or not a finite number), whether it finished."""

        def read(tx: _Tx) -> list[Observation]:
            return history(tx, sweep_id, self._sweep(tx, sweep_id).spec)

        return self._transact(read, write=False)
