"""The documents ``preemptible status`` draws: the sweep read from the queue as JSON data.

A sweep may hold 100,000 runs, so nothing here reads it run by run:

* one scan of the runs (index, state, attempts, last change; the summary of finished runs)
  counts the states and finds the best finished run: the sweep's header (``sweep`` document);
* the table shows at most ``limit`` rows: every run when there are no more, else the runs
  worth seeing (running, the best, failed/crashed/killed/preempted, requeued, then the latest
  changed) and a line saying how many runs of each state are not shown;
* ``--json`` streams every run with its attempts from one query (runs joined with their
  attempts, in order), one run per line, never holding the sweep in memory.

``snapshot`` builds the whole document in memory (the timeline and the tests use it); the
table (``_render``) and the timeline (``_timeline``) draw only from a document, so the table,
the JSON and the plot always agree and the drawing code can be tested without a database.

A JSON field of the queue that cannot be read back (``_fields``) is ``null`` in the document
and named in the run's (or sweep's) ``unreadable`` list; one warning line names the run and
the field.

Times in the document are unix seconds from the database clock; ages and running durations
are relative to ``now`` (this host's clock unless given). For SQLite both clocks are the same
host's; against PostgreSQL a skewed client clock shifts the ages, and they are clamped at 0.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import IO, Any, cast

import orjson

from ..._errors import ConfigError, StoreError
from ..._states import QueueState
from ..spec._model import GOALS
from ..store._claims import target_reached
from ..store._connector import _Tx
from ..store._endings import LEASE_EXPIRED
from ..store._fields import DECODER, decode_object, field_error
from ..store._queue import Store
from ..store._values import _metric

logger = logging.getLogger("preemptible")

STATES = tuple(QueueState)  # the order of the counts line
MAX_ROWS = 100  # the table shows at most this many runs (--watch: what fits the terminal)
_PROBLEMS = (QueueState.FAILED, QueueState.CRASHED, QueueState.KILLED, QueueState.PREEMPTED)
_WARN_LIMIT = 10  # unreadable fields named one by one; then one line says how many more
_JSON_CHUNK = 500  # runs encoded per write of --json
_RAW_DECODE = DECODER.raw_decode


# -- unreadable fields ------------------------------------------------------------------------
class _Warnings:
    """One warning line per unreadable field (the run or sweep and the field), the first
    ``_WARN_LIMIT`` of them, then one line with how many more; a field read twice (by the
    scan and for its row, or by a retried transaction) is named once."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def __call__(self, what: str, field: str, why: str) -> None:
        if (what, field) in self.seen:
            return
        self.seen.add((what, field))
        if len(self.seen) <= _WARN_LIMIT:
            logger.warning("preemptible: %s; shown as unreadable", field_error(what, field, why))

    def close(self) -> None:
        more = len(self.seen) - _WARN_LIMIT
        if more > 0:
            logger.warning(
                "preemptible: %d more unreadable fields in the sweep database (in --json: each "
                'run\'s "unreadable")',
                more,
            )


def _field(text: object, column: str, what: str, warn: _Warnings) -> tuple[Any, bool]:
    """(the decoded JSON object or None, whether it could be read); NULL is readable except
    for params and spec (NOT NULL columns)."""
    value, why = decode_object(text)
    if why is None and (value is not None or column == "summary"):
        return value, True
    warn(what, column, why or "missing (NULL)")
    return None, False


# -- the document -----------------------------------------------------------------------------
def snapshot(store: Store, sweep_id: str, *, now: float | None = None) -> dict[str, Any]:
    """The sweep and every run with its attempts, as JSON data (the ``--json`` document)."""
    at = time.time() if now is None else now
    warn = _Warnings()

    def read(tx: _Tx) -> dict[str, Any]:
        header, metric, _ = _read_header(tx, store, sweep_id, warn, keep=False)
        rows = tx.iter("status_runs", sweep_id=sweep_id)
        return {"sweep": header, "runs": list(_run_docs(rows, metric, at, warn))}

    try:
        return store.read(read)
    finally:
        warn.close()


def table_snapshot(
    store: Store, sweep_id: str, *, now: float | None = None, limit: int = MAX_ROWS
) -> dict[str, Any]:
    """The document the table draws: the sweep, at most ``limit`` runs (all of them when there
    are no more, else those worth seeing), and ``hidden``: how many runs of each state are not
    among them (absent when none is hidden)."""
    at = time.time() if now is None else now
    warn = _Warnings()

    def read(tx: _Tx) -> dict[str, Any]:
        header, metric, scanned = _read_header(tx, store, sweep_id, warn, keep=True)
        best = header["best"]["run_id"] if header["best"] else None
        runs = [
            doc
            for run_id in _pick_rows(scanned, best, limit)
            for doc in _run_docs(tx.iter("status_run", id=run_id), metric, at, warn)
        ]
        doc: dict[str, Any] = {"sweep": header, "runs": runs}
        if len(runs) < len(scanned):
            hidden = dict(header["counts"])
            for run in runs:
                hidden[run["state"]] -= 1
            doc["hidden"] = {"runs": len(scanned) - len(runs), "counts": hidden}
        return doc

    try:
        return store.read(read)
    finally:
        warn.close()


def write_json(store: Store, sweep_id: str, out: IO[str], *, now: float | None = None) -> None:
    """Print the ``snapshot`` document into ``out`` as it is read: ``{"sweep": {...}, "runs":
    [`` then a line per run, then ``]}``. A database that fails after the first byte was
    written is a StoreError (the output is then cut short), never a second copy of it."""
    at = time.time() if now is None else now
    warn = _Warnings()
    begun = False

    def read(tx: _Tx) -> None:
        nonlocal begun
        if begun:
            raise StoreError(
                f"the sweep database {store.display} failed in the middle of the output, "
                "which is incomplete; run the command again"
            )
        known: dict[str, Any] = {}  # finished runs' summaries, decoded once
        header, metric, _ = _read_header(tx, store, sweep_id, warn, keep=False, known=known)
        rows = _run_docs(tx.iter("status_runs", sweep_id=sweep_id), metric, at, warn, known)
        begun = True
        _dump(header, rows, out)

    try:
        store.read(read)
    finally:
        warn.close()


def _dump(header: Mapping[str, Any], runs: Iterable[Mapping[str, Any]], out: IO[str]) -> None:
    out.write('{"sweep": ' + _encode(header) + ',\n"runs": [')
    separator = "\n"
    chunk: list[str] = []
    for run in runs:
        chunk.append(_encode(run))
        if len(chunk) >= _JSON_CHUNK:
            out.write(separator + ",\n".join(chunk))
            separator, chunk = ",\n", []
    if chunk:
        out.write(separator + ",\n".join(chunk))
    out.write("\n]}\n")


# documents built here hold no cycles: not checking for them saves 15 % of --json's encoding
_ENCODER = json.JSONEncoder(allow_nan=False, check_circular=False)


def _encode(doc: Mapping[str, Any]) -> str:
    """One document as JSON: orjson (five times the standard library's speed: encoding was
    40 % of ``--json``), which writes an infinite or NaN float as null; the standard library
    for what orjson refuses (an integer wider than 64 bits)."""
    try:
        return orjson.dumps(doc).decode()
    except orjson.JSONEncodeError:
        pass
    try:
        return _ENCODER.encode(doc)
    except ValueError:  # a stored number too large for a float (1e999), read as inf
        return _ENCODER.encode(_finite(doc))


def _finite(value: Any) -> Any:
    """``value`` with every infinite float as None (JSON has no infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def sweeps_snapshot(store: Store) -> list[dict[str, Any]]:
    """One summary per sweep in the database, oldest first (``status`` without a sweep id)."""
    warn = _Warnings()

    def read(tx: _Tx) -> list[dict[str, Any]]:
        return [_header(tx, row, warn, keep=False)[0] for row in tx.all("list_sweeps")]

    try:
        return store.read(read)
    finally:
        warn.close()


_Scanned = tuple[int, str, str, int, float]  # (index, id, state, attempts, updated_at)


def _read_header(
    tx: _Tx,
    store: Store,
    sweep_id: str,
    warn: _Warnings,
    *,
    keep: bool,
    known: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], str | None, list[_Scanned]]:
    row = tx.one("get_sweep", id=sweep_id)
    if row is None:
        raise ConfigError(f"no sweep {sweep_id!r} in {store.display}")
    return _header(tx, row, warn, keep=keep, known=known)


def _header(
    tx: _Tx,
    row: Mapping[str, Any],
    warn: _Warnings,
    *,
    keep: bool,
    known: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], str | None, list[_Scanned]]:
    """The sweep's document (counts and best from one scan of its runs), its metric's name,
    and the scanned runs when ``keep``; ``known`` gets the summaries decoded on the way."""
    doc = sweep_head(row, warn)
    metric = doc["metric"]
    sign = -1.0 if metric is not None and metric["goal"] == "maximize" else 1.0
    counts = dict.fromkeys(STATES, 0)
    best_key: tuple[float, int] | None = None
    best = None
    scanned: list[_Scanned] = []
    for run_id, index, state, attempts, updated_at, text in tx.iter(
        "status_scan", sweep_id=row["id"]
    ):
        counts[state] = counts.get(state, 0) + 1
        if keep:
            scanned.append((index, run_id, state, attempts, updated_at))
        if metric is None or text is None:
            continue
        # the best final result: a finished run's last reported value (running runs report
        # intermediate values, shown in their own rows)
        summary, _ = _field(text, "summary", f"run {run_id}", warn)
        if known is not None and summary is not None:
            known[run_id] = summary
        value = _metric_of(summary, metric["name"])
        if value is not None and (best_key is None or (sign * value, index) < best_key):
            best_key = (sign * value, index)
            best = {"run_id": run_id, "metric": value}
    doc["counts"], doc["best"] = counts, best
    if doc["target"] is not None:  # only for a sweep with a target: a scan of the summaries
        spec, _ = decode_object(row["spec"])
        reached = target_reached(tx, row["id"], spec or {})
        if reached is not None:
            doc["target"].update(run_id=reached[0], metric=reached[1])
    return doc, metric["name"] if metric else None, scanned


def sweep_head(row: Mapping[str, Any], warn: _Warnings) -> dict[str, Any]:
    """The sweep's document from its row (``get_sweep``), with ``counts`` all 0 and no
    ``best``: the caller counts its runs."""
    spec, readable = _field(row["spec"], "spec", f"sweep {row['id']}", warn)
    spec = spec or {}
    method = spec.get("method")
    return {
        "id": row["id"],
        "name": row["name"],
        "control": row["control"],
        "method": method if isinstance(method, str) else None,
        "metric": _metric_spec(spec),
        "run_cap": row["run_cap"],
        "runs_created": row["runs_created"],
        "counts": dict.fromkeys(STATES, 0),
        "best": None,
        "target": _target_spec(spec),
        "created_at": row["created_at"],
        "unreadable": [] if readable else ["spec"],
    }


def _target_spec(spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """``{"value": metric.target, "run_id": None, "metric": None}`` (the first run to reach it,
    and its value, once one has), or None when the spec has no valid target."""
    metric = spec.get("metric")
    target = metric.get("target") if isinstance(metric, Mapping) else None
    if isinstance(target, bool) or not isinstance(target, (int, float)):
        return None
    if not math.isfinite(target) or _metric_spec(spec) is None:
        return None
    return {"value": target, "run_id": None, "metric": None}


def _metric_spec(spec: Mapping[str, Any]) -> dict[str, str] | None:
    """The spec's metric, read leniently: a stored spec is shown as it is, valid or not."""
    metric = spec.get("metric")
    if not isinstance(metric, Mapping) or not isinstance(metric.get("name"), str):
        return None
    goal = metric.get("goal")
    return {"name": metric["name"], "goal": goal if goal in GOALS else "minimize"}


def _pick_rows(scanned: Sequence[_Scanned], best: str | None, limit: int) -> list[str]:
    """The ids of the runs the table shows, in index order: all of them when there are at
    most ``limit``; else, up to ``limit``, running runs (the longest without a heartbeat
    first, up to 40 % of the rows), the best, the latest failed, crashed, killed or preempted
    ones (up to 30 %), the latest requeued ones (up to 10 %), then the latest changed of any
    state; rows a group leaves over go to the next."""
    if len(scanned) <= limit:
        return [r[1] for r in scanned]

    def latest(rows: Iterable[_Scanned]) -> list[_Scanned]:
        return heapq.nlargest(limit, rows, key=lambda r: (r[4], r[0]))

    running = QueueState.RUNNING
    groups = [
        (heapq.nsmallest(limit, (r for r in scanned if r[2] == running), key=lambda r: r[4]), 0.4),
        ([r for r in scanned if r[1] == best], 1.0),
        (latest(r for r in scanned if r[2] in _PROBLEMS), 0.3),
        (latest(r for r in scanned if r[2] == QueueState.PENDING and r[3] > 0), 0.1),
        (latest(scanned), 1.0),
    ]
    chosen: dict[str, int] = {}
    for share in (True, False):  # first each group its share, then whatever is left over
        for rows, part in groups:
            quota = max(1, int(limit * part)) if share else limit
            for taken, r in enumerate(rows):
                if len(chosen) >= limit or taken >= quota:
                    break
                chosen.setdefault(r[1], r[0])
    return sorted(chosen, key=chosen.__getitem__)


def _run_docs(
    rows: Iterable[tuple[Any, ...]],
    metric: str | None,
    now: float,
    warn: _Warnings,
    known: dict[str, Any] | None = None,
) -> Iterator[dict[str, Any]]:
    """A run document per run from ``status_runs`` rows: the run's 11 columns, then its
    attempt's 11 (NULL for a run without attempts), a row per attempt, in order. ``known``:
    summaries the scan decoded already, by run id (taken out as they are used)."""
    run: tuple[Any, ...] | None = None
    log: list[dict[str, Any]] = []
    for row in rows:
        if run is None or row[0] != run[0]:
            if run is not None:
                yield _run_doc(run, log, metric, now, warn, known)
            run, log = row, []
        if row[11] is not None:
            log.append(_attempt_doc(row[11:], now))
    if run is not None:
        yield _run_doc(run, log, metric, now, warn, known)


def _object(
    text: object, column: str, run_id: str, warn: _Warnings, unreadable: list[str]
) -> dict[str, Any] | None:
    """``_field`` with a fast path for the usual case, a JSON object with nothing around it
    (a sweep of 100,000 runs decodes 200,000 of them)."""
    if type(text) is str:
        try:
            value, end = _RAW_DECODE(text)
        except (ValueError, RecursionError):
            pass
        else:
            if type(value) is dict and end == len(text):
                return value
    decoded, readable = _field(text, column, f"run {run_id}", warn)
    if not readable:
        unreadable.append(column)
    return cast("dict[str, Any] | None", decoded)


def _metric_of(summary: dict[str, Any] | None, name: str | None) -> float | None:
    if summary is not None and name is not None:
        value = summary.get(name)
        if type(value) is float and math.isfinite(value):
            return value
    return _metric(summary, name)


def _run_doc(
    r: tuple[Any, ...],
    log: list[dict[str, Any]],
    metric: str | None,
    now: float,
    warn: _Warnings,
    known: dict[str, Any] | None = None,
) -> dict[str, Any]:
    run_id, index, params_text, state, attempt, preemptions, failures = r[:7]
    owner, owner_host, summary_text, updated_at = r[7:11]
    unreadable: list[str] = []
    params = _object(params_text, "params", run_id, warn, unreadable)
    summary = known.pop(run_id, None) if known else None
    if summary is None and summary_text is not None:
        summary = _object(summary_text, "summary", run_id, warn, unreadable)
    step = None
    for a in log:
        if a["checkpoint_step"] is not None:
            step = a["checkpoint_step"]
    newest = log[-1] if log else None
    heartbeat_age = None
    if state == QueueState.RUNNING:
        # updated_at of a RUNNING run is its last claim, heartbeat or relayed report: each is
        # the lease holder showing it is alive (the lease length itself is not stored)
        heartbeat_age = max(0.0, now - updated_at)
    return {
        "run_id": run_id,
        "index": index,
        "params": params,
        "state": state,
        "attempts": attempt,
        "preemptions": preemptions,
        "failures": failures,
        "checkpoint_step": step,
        "metric": _metric_of(summary, metric),
        "summary": summary,
        "agent": newest["agent"] if newest else owner,
        "host": newest["host"] if newest else owner_host,
        "heartbeat_age": heartbeat_age,
        "duration": log[0]["duration"] if len(log) == 1 else math.fsum(a["duration"] for a in log),
        "attempt_log": log,
        "unreadable": unreadable,
    }


def _attempt_doc(a: tuple[Any, ...], now: float) -> dict[str, Any]:
    number, agent, host, started_at, ended_at, ending, exit_code, duration, step, closed_by = a[:10]
    late = bool(a[10]) if len(a) > 10 else False
    if duration is None:  # running (elapsed so far), or ended without a measure (lease lost)
        duration = max(0.0, (ended_at if ended_at is not None else now) - started_at)
    return {
        "number": number,
        "agent": agent,
        "host": host,
        "started_at": started_at,
        "ended_at": ended_at,
        "ending": ending,
        "lost": closed_by == LEASE_EXPIRED,
        "late": late,  # its own result came after another agent took the run over
        "exit_code": exit_code,
        "duration": duration,
        "checkpoint_step": step,
    }
