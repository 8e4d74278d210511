"""What the sweep queue hands out: its rows as frozen dataclasses, and the one mapping from
a database row (a dict of columns, ``_Tx.all``) to them (``from_row``).

A field is read from the column of its name, or from the one its metadata names
(``column``); a ``bool`` field is converted (SQLite stores 0 and 1). JSON fields are decoded
by the caller (``sweep_row``, ``run_row``, ``claim_row``), each with its own rule for a value
that cannot be read back (``_fields``), and passed in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from ._fields import decode_object, field_error, strict_object

R = TypeVar("R")
_RUN_INDEX: Mapping[str, str] = {"column": "run_index"}
_LEASE_EPOCH: Mapping[str, str] = {"column": "lease_epoch"}
_COLUMNS: dict[type, tuple[tuple[str, str, bool], ...]] = {}


@dataclass(frozen=True)
class SweepRow:
    id: str
    name: str | None
    spec: dict[str, Any]
    control: str
    cancel_now: bool
    run_cap: int | None
    max_failures: int
    max_preemptions: int
    seed: int
    runs_created: int
    created_at: float
    unreadable: tuple[str, ...] = ()  # "spec" when it cannot be read back (spec is then {})


@dataclass(frozen=True)
class RunRow:
    id: str
    sweep_id: str
    index: int = field(metadata=_RUN_INDEX)
    params: dict[str, Any]
    state: str
    attempt: int
    preemptions: int
    failures: int
    lease_owner: str | None
    lease_host: str | None
    lease_expires: float | None
    checkpoint_dir: str
    summary: dict[str, Any] | None
    created_at: float
    updated_at: float
    # the JSON fields that cannot be read back (_fields): params is then {}, summary None
    unreadable: tuple[str, ...] = ()
    epoch: int = field(default=0, metadata=_LEASE_EPOCH)  # of the newest claim (kept after
    # the run is handed back)
    early_exempt: bool = False  # resumed by the user after early termination: never judged


@dataclass(frozen=True)
class AttemptRow:
    run_id: str
    number: int
    agent: str
    host: str
    started_at: float
    ended_at: float | None
    ending: str | None
    exit_code: int | None
    duration: float | None
    checkpoint_step: int | None
    marked_preempting: bool
    outcome: str | None  # the run's state after this attempt
    closed_by: str | None  # the agent that ended it, or LEASE_EXPIRED
    epoch: int | None = None  # the lease epoch of its claim (None: before schema version 2)
    late: bool = False  # its result came after another agent took the run over (ending real)


@dataclass(frozen=True)
class Claim:
    """A run handed to one agent for one attempt. ``checkpoint_dir`` is a directory name (the
    run id): the agent decides where it lives; every attempt of the run gets the same one."""

    run_id: str = field(metadata={"column": "id"})
    sweep_id: str
    index: int = field(metadata=_RUN_INDEX)
    params: dict[str, Any]
    attempt: int
    checkpoint_dir: str
    preemptions: int
    failures: int
    # the lease epoch: heartbeats, finish, release and abandon carry it
    epoch: int = field(default=0, metadata=_LEASE_EPOCH)


class Orders(NamedTuple):
    """What a heartbeat answers: the sweep's control and whether a cancel is immediate."""

    control: str
    cancel_now: bool


def _columns(cls: type) -> tuple[tuple[str, str, bool], ...]:
    """(field, column, whether a bool) of every field of dataclass ``cls``."""
    found = _COLUMNS.get(cls)
    if found is None:
        found = _COLUMNS[cls] = tuple(
            (f.name, f.metadata.get("column", f.name), f.type in ("bool", bool))
            for f in dataclasses.fields(cls)
        )
    return found


def from_row(cls: type[R], row: Mapping[str, Any], /, **values: Any) -> R:
    """A ``cls`` (a dataclass above) from a database row: each field its column's value (a
    missing column is a KeyError: a query and its dataclass disagree), but those in
    ``values``; the row's other columns are ignored."""
    kwargs = dict(values)
    for name, column, is_bool in _columns(cls):
        if name not in kwargs:
            kwargs[name] = bool(row[column]) if is_bool else row[column]
    return cls(**kwargs)


def sweep_row(r: Mapping[str, Any], *, strict: bool = True) -> SweepRow:
    """The sweep; its spec must be readable (``strict``: an agent cannot run the sweep
    without it, UnreadableField), else it is {} and named in ``unreadable``."""
    spec, why = decode_object(r["spec"])
    if why is not None and strict:
        raise field_error(f"sweep {r['id']}", "spec", why)
    return from_row(SweepRow, r, spec=spec or {}, unreadable=() if why is None else ("spec",))


def run_row(r: Mapping[str, Any]) -> RunRow:
    """The run; a JSON field that cannot be read back is empty and named in ``unreadable``."""
    params, _ = decode_object(r["params"])  # NOT NULL: None means unreadable
    summary, summary_why = decode_object(r["summary"])
    unreadable = (("params",) if params is None else ()) + (("summary",) if summary_why else ())
    return from_row(RunRow, r, params=params or {}, summary=summary, unreadable=unreadable)


def claim_row(r: Mapping[str, Any]) -> Claim:
    """The claim; its parameters must be readable (UnreadableField)."""
    return from_row(Claim, r, params=strict_object(r["params"], f"run {r['id']}", "params"))
