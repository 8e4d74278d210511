"""Sweeps made and steered from outside: creating one, queueing its runs (a grid laid out at
once), and its control (running, paused, stopped, cancelled).

``ControlStore`` is a mixin of ``Store`` (``_queue``), which gives the transactions.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from ..._errors import ConfigError
from ..._states import Control
from ._claims import insert_run
from ._connector import _Tx
from ._reads import ReadStore
from ._values import _check_int, _json, _new_id

ControlName = Control | str  # a Control, or its value
CONTROLS = tuple(c.value for c in Control)


class ControlStore(ReadStore):
    """The sweep-control part of ``Store`` (a mixin: ``Store`` gives the transactions)."""

    def create_sweep(
        self,
        spec: Mapping[str, Any],
        *,
        name: str | None,
        run_cap: int | None,
        max_failures: int,
        max_preemptions: int,
        seed: int | None = None,
    ) -> str:
        """A new sweep, running; its id (8 letters and digits). ``seed`` None: a random one,
        stored, so that every agent samples the same sequence."""
        if not isinstance(spec, Mapping):
            raise ConfigError(f"the sweep spec must be a mapping, not {type(spec).__name__}")
        spec_text = _json(dict(spec), "the sweep spec")
        if name is not None and not isinstance(name, str):
            raise ConfigError(f"name={name!r} is not valid; use a string or None")
        _check_int("run_cap", run_cap, 1, none_ok=True)
        _check_int("max_failures", max_failures, 0)
        _check_int("max_preemptions", max_preemptions, 0)
        _check_int("seed", seed, 0, high=2**63 - 1, none_ok=True)
        values = {
            "name": name,
            "spec": spec_text,
            "run_cap": run_cap,
            "max_failures": max_failures,
            "max_preemptions": max_preemptions,
            "seed": seed if seed is not None else secrets.randbelow(2**31),
        }
        while True:
            sweep_id, token = _new_id(), secrets.token_hex(8)

            def insert(tx: _Tx, sweep_id: str = sweep_id, token: str = token) -> bool:
                tx.run("insert_sweep", id=sweep_id, token=token, **values)
                row = tx.one("sweep_token", id=sweep_id)
                return row is not None and row["create_token"] == token

            if self._transact(insert):  # else: the id was taken by another sweep; draw again
                return sweep_id

    def set_control(self, sweep_id: str, control: ControlName, *, now: bool = False) -> None:
        """running (resume), paused, stopped (no new claims; running runs finish) or cancelled
        (pending runs are cancelled; agents stop their runs, at once with ``now``). A cancelled
        sweep stays cancelled."""
        if control not in CONTROLS:
            raise ConfigError(f"control={control!r} is not valid; use one of {', '.join(CONTROLS)}")
        if now and control != Control.CANCELLED:
            raise ConfigError("now=True goes only with control='cancelled'")

        def change(tx: _Tx) -> None:
            row = tx.one("lock_sweep", id=sweep_id)
            if row is None:
                raise self._no_sweep(sweep_id)
            if row["control"] == Control.CANCELLED and control != Control.CANCELLED:
                raise ConfigError(
                    f"sweep {sweep_id!r} is cancelled; a cancelled sweep cannot be {control}"
                )
            cancel_now = int(control == Control.CANCELLED and (now or bool(row["cancel_now"])))
            tx.run("set_control", id=sweep_id, control=control, cancel_now=cancel_now)
            if control == Control.CANCELLED:
                tx.run("cancel_pending", sweep_id=sweep_id)

        self._transact(change)

    def add_runs(self, sweep_id: str, params: Sequence[Mapping[str, Any]]) -> list[str]:
        """Queue runs with these parameters (a grid laid out at once); their ids, in order."""
        texts = [_json(dict(p), "run parameters") for p in params]
        token = secrets.token_hex(8)

        def add(tx: _Tx) -> list[str]:
            if tx.retry:
                done = tx.all("runs_by_create_token", token=token)
                if done:
                    return [r["id"] for r in done]
            row = tx.one("lock_sweep", id=sweep_id)
            if row is None:
                raise self._no_sweep(sweep_id)
            if row["control"] == Control.CANCELLED:
                raise ConfigError(f"sweep {sweep_id!r} is cancelled; it takes no new runs")
            first, cap = row["runs_created"], row["run_cap"]
            if cap is not None and first + len(texts) > cap:
                raise ConfigError(
                    f"sweep {sweep_id!r} has {first} of its {cap} runs (run_cap); "
                    f"{len(texts)} more do not fit"
                )
            ids = [insert_run(tx, sweep_id, first + i, t, token) for i, t in enumerate(texts)]
            tx.run("count_created", id=sweep_id, n=len(texts))
            return ids

        return self._transact(add)
