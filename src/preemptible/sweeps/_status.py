"""What ``preemptible status`` shows: the sweep read from the queue as JSON data, then drawn.

A sweep may hold 100,000 runs, so nothing here reads it run by run:

* one scan of the runs (index, state, attempts, last change; the summary of finished runs)
  counts the states and finds the best finished run: the sweep's header (``sweep`` document);
* the table shows at most ``limit`` rows: every run when there are no more, else the runs
  worth seeing (running, the best, failed/crashed/killed/preempted, requeued, then the latest
  changed) and a line saying how many runs of each state are not shown;
* ``--json`` streams every run with its attempts from one query (runs joined with their
  attempts, in order), one run per line, never holding the sweep in memory.

``snapshot`` builds the whole document in memory (the timeline and the tests use it);
``render`` and ``plot_timeline`` draw only from a document, so the table, the JSON and the plot
always agree and the drawing code can be tested without a database.

A JSON field of the queue that cannot be read back (``_fields``) is ``null`` in the document
and named in the run's (or sweep's) ``unreadable`` list; the table says "(unreadable)"; one
warning line names the run and the field. Everything else is shown as usual.

Times in the document are unix seconds from the database clock; ages and running durations
are relative to ``now`` (this host's clock unless given). For SQLite both clocks are the same
host's; against PostgreSQL a skewed client clock shifts the ages, and they are clamped at 0.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import orjson
from rich.cells import cell_len
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from .._env import env_float
from .._errors import ConfigError, PreemptibleError, StoreError
from .._states import Ending, QueueState
from .._text import format_age as format_age  # importable from here, as before
from .._text import printable
from ._fields import DECODER, decode_object, field_error
from ._spec import GOALS
from ._store import (
    DEFAULT_RETRY_TIMEOUT,
    LEASE_EXPIRED,
    Store,
    _metric,
    _Tx,
    open_store,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger("preemptible")

STATES = tuple(QueueState)  # the order of the counts line
STATE_STYLES = {
    QueueState.FINISHED: "green",
    QueueState.RUNNING: "blue",
    QueueState.PENDING: "dim",
    QueueState.PREEMPTED: "yellow",
    QueueState.CRASHED: "yellow",
    QueueState.FAILED: "red",
    QueueState.KILLED: "red",
    QueueState.CANCELLED: "grey50",
}
# Bar colours of the timeline by how the attempt ended (None: still running).
ENDING_COLOURS: dict[str | None, str] = {
    Ending.FINISHED: "#2ca02c",
    Ending.PREEMPTED: "#ffbf00",
    Ending.CRASHED: "#ff7f0e",
    Ending.FAILED: "#d62728",
    Ending.KILLED: "#8c1c13",
    Ending.CANCELLED: "#7f7f7f",
    Ending.RELEASED: "#c7c7c7",
    None: "#1f77b4",
}
PLOT_INSTALL = "pip install 'preemptible[plot]'"
MAX_ROWS = 100  # the table shows at most this many runs (--watch: what fits the terminal)
UNREADABLE = "(unreadable)"
_PROBLEMS = (QueueState.FAILED, QueueState.CRASHED, QueueState.KILLED, QueueState.PREEMPTED)
_VALUE_WIDTH = 24  # a parameter value longer than this is shortened
_MAX_LABELS = 50  # the timeline labels at most this many runs on its y axis
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
    spec, readable = _field(row["spec"], "spec", f"sweep {row['id']}", warn)
    spec = spec or {}
    metric = _metric_spec(spec)
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
    method = spec.get("method")
    doc = {
        "id": row["id"],
        "name": row["name"],
        "control": row["control"],
        "method": method if isinstance(method, str) else None,
        "metric": metric,
        "run_cap": row["run_cap"],
        "runs_created": row["runs_created"],
        "counts": counts,
        "best": best,
        "created_at": row["created_at"],
        "unreadable": [] if readable else ["spec"],
    }
    return doc, metric["name"] if metric else None, scanned


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
    attempt's 10 (NULL for a run without attempts), a row per attempt, in order. ``known``:
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
    number, agent, host, started_at, ended_at, ending, exit_code, duration, step, closed_by = a
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
        "exit_code": exit_code,
        "duration": duration,
        "checkpoint_step": step,
    }


# -- the tables -------------------------------------------------------------------------------
# Every text in the table comes from the queue, which any agent, run or spec writes: a name or
# a value with an escape sequence must not drive the terminal, so control characters are shown
# escaped (``\x1b``), as ``repr`` would (``--json`` is JSON, escaped by ``json.dumps``).
def _text(value: object, style: str = "") -> Text:
    return Text(printable(str(value)), style=style)


class _Column:
    """A column of a table before it is drawn: its cells, and what it needs to be readable."""

    def __init__(self, header: str | Text, *, flexible: bool = False, **options: Any) -> None:
        self.header = header
        self.flexible = flexible  # folds its text: it can be narrower than its longest cell
        self.options = options
        self.cells: list[Text] = []

    def width(self) -> int:
        header = self.header.plain if isinstance(self.header, Text) else self.header
        widest = max([cell_len(header), *(cell_len(c.plain) for c in self.cells)])
        return min(widest, 20) if self.flexible else widest


def _fit(columns: dict[str, _Column], drop: Sequence[str], width: int | None) -> Table:
    """A table of ``columns``; when ``width`` is given, the columns named in ``drop`` go, in
    that order, until the others fit (those never named always stay: at least a run's id and
    its state are always shown)."""
    shown = dict(columns)
    for name in drop:
        if width is None or sum(c.width() for c in shown.values()) + 3 * (len(shown) - 1) <= width:
            break
        del shown[name]
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    for column in shown.values():
        table.add_column(column.header, **column.options)
    for row in zip(*(c.cells for c in shown.values()), strict=True):
        table.add_row(*row)
    return table


# the run table's columns in the order they go when the terminal is too narrow for all
_RUN_DROPS = ("agent@host", "heartbeat", "ckpt step", "duration", "params", "attempts", "metric")


def render(doc: Mapping[str, Any], *, now: float | None = None, width: int | None = None) -> Group:
    """A header line about the sweep, then one row per run in index order (and a line about
    the runs not shown); ``width``: the columns that do not fit go first (``_RUN_DROPS``)."""
    sweep = doc["sweep"]
    metric = sweep.get("metric")
    best = sweep.get("best") or {}
    arrow = "↑" if metric and metric.get("goal") == "maximize" else "↓"
    columns = {
        "run": _Column("run", overflow="fold"),
        "params": _Column("params", flexible=True, overflow="fold", ratio=1),
        "state": _Column("state", no_wrap=True),
        "attempts": _Column("attempts", no_wrap=True),
        "ckpt step": _Column("ckpt step", justify="right", no_wrap=True),
        # a Text header: a metric name is the user's text, never rich markup
        "metric": _Column(
            _text(f"{metric['name']} {arrow}") if metric else "metric",
            justify="right",
            no_wrap=True,
        ),
        "agent@host": _Column("agent@host", overflow="fold"),
        "heartbeat": _Column("heartbeat", justify="right", no_wrap=True),
        "duration": _Column("duration", justify="right", no_wrap=True),
    }
    runs = sorted(doc["runs"], key=lambda r: r["index"])
    for run in runs:
        state = run["state"]
        unreadable = run.get("unreadable") or ()
        value = run.get("metric")
        if value is not None:
            shown = Text(f"{value:.6g}")
            if run["run_id"] == best.get("run_id"):
                shown.stylize("bold")
        else:
            shown = Text("?", style="red") if "summary" in unreadable else Text("-")
        extra = [f"{n}{c}" for n, c in ((run["preemptions"], "p"), (run["failures"], "f")) if n]
        attempts = str(run["attempts"]) + (f" ({' '.join(extra)})" if extra else "")
        step = run.get("checkpoint_step")
        where = f"{run['agent']}@{run['host']}" if run.get("agent") else "-"
        params = run.get("params")
        cells = {
            "run": _text(run["run_id"]),
            "params": _text(UNREADABLE, "red") if params is None else _text(format_params(params)),
            "state": _text(state, STATE_STYLES.get(state, "")),
            "attempts": _text(attempts),
            "ckpt step": _text("-" if step is None else step),
            "metric": shown,
            "agent@host": _text(where),
            "heartbeat": _text(format_age(run.get("heartbeat_age"))),
            "duration": _text(format_age(run.get("duration") if run["attempts"] else None)),
        }
        for name, cell in cells.items():
            columns[name].cells.append(cell)
    # never squeezed, even where the run id alone fills the terminal
    columns["state"].options["min_width"] = columns["state"].width()
    table = _fit(columns, _RUN_DROPS, width)
    if not runs:
        table.caption = "no runs yet"
    parts: list[RenderableType] = [_header_line(sweep, time.time() if now is None else now), table]
    hidden = doc.get("hidden")
    if hidden:
        parts.append(_hidden_line(hidden, len(runs)))
    return Group(*parts)


def _hidden_line(hidden: Mapping[str, Any], shown: int) -> Text:
    text = Text(f"{hidden['runs']:,} more runs not shown", style="bold")
    states = [(s, n) for s, n in hidden["counts"].items() if n > 0]
    for i, (state, n) in enumerate(states):
        text.append(": " if i == 0 else ", ")
        text.append(printable(f"{n:,} {state}"), style=STATE_STYLES.get(state, ""))
    text.append(
        f" (the {shown} above: running runs, the best, the latest failed, preempted and "
        "requeued ones, then the latest changed; --json lists every run)",
        style="dim",
    )
    return text


def _header_line(sweep: Mapping[str, Any], now: float) -> Text:
    text = Text()
    text.append(printable(f"sweep {sweep['id']}"), style="bold")
    if sweep.get("name"):
        text.append(printable(f" {sweep['name']!r}"))
    text.append(printable(f" · {sweep['control']}"))
    if "spec" in (sweep.get("unreadable") or ()):
        text.append(" · spec " + UNREADABLE, style="red")
    if sweep.get("method"):
        text.append(printable(f" · {sweep['method']}"))
    metric = sweep.get("metric")
    if metric:
        text.append(printable(f" · {metric['goal']} {metric['name']}"))
    cap = sweep.get("run_cap")
    text.append(f" · {sweep['runs_created']}{'' if cap is None else f'/{cap}'} runs")
    counts = [(s, n) for s, n in sweep["counts"].items() if n]
    for i, (state, n) in enumerate(counts):
        text.append(": " if i == 0 else ", ")
        text.append(printable(f"{n} {state}"), style=STATE_STYLES.get(state, ""))
    best = sweep.get("best")
    if best and metric:
        text.append(printable(f" · best {best['run_id']} {metric['name']}={best['metric']:.6g}"))
    text.append(f" · created {format_age(now - sweep['created_at'])} ago")
    return text


_SWEEP_DROPS = ("created", "best", "method", "metric", "control", "name", "runs")


def render_sweeps(rows: Sequence[Mapping[str, Any]], *, width: int | None = None) -> Table:
    """One row per sweep (``sweeps_snapshot``); ``width``: the columns that do not fit go
    first (``_SWEEP_DROPS``), never the sweep's id and its runs' states."""
    columns = {
        name: _Column(name, overflow="fold")
        for name in ("sweep", "name", "control", "method", "metric", "runs", "states", "best")
    }
    columns["created"] = _Column("created", no_wrap=True)
    for row in rows:
        metric = row.get("metric")
        best = row.get("best")
        states = Text()
        for state, n in row["counts"].items():
            if n:
                states.append(", " if states else "")
                states.append(printable(f"{n} {state}"), style=STATE_STYLES.get(state, ""))
        cap = row.get("run_cap")
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["created_at"]))
        if "spec" in (row.get("unreadable") or ()):
            shown_metric = _text(UNREADABLE, "red")
        else:
            shown_metric = _text(f"{metric['goal']} {metric['name']}" if metric else "-")
        cells = {
            "sweep": _text(row["id"]),
            "name": _text(row.get("name") or "-"),
            "control": _text(row["control"]),
            "method": _text(row.get("method") or "-"),
            "metric": shown_metric,
            "runs": _text(f"{row['runs_created']}{'' if cap is None else f'/{cap}'}"),
            "states": states if states else Text("-"),
            "best": _text(f"{best['run_id']} {best['metric']:.6g}" if best else "-"),
            "created": _text(created),
        }
        for name, cell in cells.items():
            columns[name].cells.append(cell)
    table = _fit(columns, _SWEEP_DROPS, width)
    if not rows:
        table.caption = "no sweeps yet"
    return table


def format_params(params: Mapping[str, Any]) -> str:
    """``k=v`` pairs, nested groups flattened to ``a.b=v``, long values shortened, control
    characters escaped (``printable``)."""
    return printable(" ".join(f"{key}={_short(value)}" for key, value in _flatten(params, "")))


def _flatten(params: Mapping[str, Any], prefix: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in params.items():
        if isinstance(value, Mapping) and value:
            out.extend(_flatten(value, f"{prefix}{key}."))
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _short(value: Any) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, float):
        text = f"{value:.6g}"
    else:
        text = json.dumps(value, separators=(",", ":"))
    text = " ".join(text.split())  # one line
    return text if len(text) <= _VALUE_WIDTH else text[: _VALUE_WIDTH - 1] + "…"


# -- --watch ----------------------------------------------------------------------------------
def watch(
    look: Callable[[], RenderableType],
    interval: float,
    show: Callable[[RenderableType], None],
    *,
    stale_after: float | None = None,
    rounds: int | None = None,
) -> None:
    """Show ``look()`` every ``interval`` seconds (``rounds`` times; None: until Ctrl+C).

    ``look`` runs in a thread of its own, one at a time, so that a database that fails
    (``look`` raises a PreemptibleError) or stops answering (no result within ``stale_after``
    seconds) never leaves an old table on the screen as if it were current: the last table
    is shown under a line "database unreachable since HH:MM:SS, showing the last table (of
    HH:MM:SS)", with the reason when known, until a look succeeds again."""
    stale_after = max(5.0, 2.0 * interval) if stale_after is None else stale_after
    results: queue.Queue[tuple[bool, Any]] = queue.Queue()
    view: RenderableType | None = None
    view_at: float | None = None
    down_since: float | None = None
    reason: str | None = None

    def work() -> None:
        try:
            results.put((True, look()))
        except BaseException as exc:  # a bug too: raised again in the caller's thread
            results.put((False, exc))

    def frame() -> RenderableType:
        if down_since is None:
            assert view is not None
            return view
        marker = Text(f"database unreachable since {_clock(down_since)}, ", style="bold red")
        if view is None:
            marker.append("no table read yet", style="bold red")
        else:
            marker.append(f"showing the last table (of {_clock(view_at)})", style="bold red")
        lines: list[RenderableType] = [marker]
        if reason:
            lines.append(Text(printable(reason), style="dim"))
        if view is not None:
            lines.append(view)
        return Group(*lines)

    done = 0
    while rounds is None or done < rounds:
        started = time.time()
        threading.Thread(target=work, name="preemptible-status", daemon=True).start()
        while True:
            try:
                ok, value = results.get(timeout=stale_after if down_since is None else interval)
                break
            except queue.Empty:
                if down_since is None:
                    down_since, reason = started, f"no answer for {stale_after:g} s"
                    show(frame())
        if ok:
            view, view_at, down_since, reason = value, time.time(), None, None
        elif isinstance(value, PreemptibleError):
            down_since = started if down_since is None else down_since
            reason = str(value)
        else:
            raise value
        show(frame())
        done += 1
        if rounds is None or done < rounds:
            time.sleep(interval)


def _clock(at: float | None) -> str:
    return "-" if at is None else time.strftime("%H:%M:%S", time.localtime(at))


# -- the command ------------------------------------------------------------------------------
def show_status(
    db: str | None,
    sweep_id: str | None,
    *,
    as_json: bool = False,
    watch_every: float | None = None,
    plot: Path | None = None,
    out: IO[str] | None = None,
) -> None:
    """``preemptible status``: the sweeps in the database, or one sweep's runs, as a table
    (``watch_every`` seconds: refreshed until Ctrl+C), as JSON, or drawn (``plot``). The
    database is only read (``open_store(reader=True)``)."""
    from rich.console import Console

    if sweep_id is None and plot is not None:
        raise ConfigError("--plot needs a SWEEP_ID")
    out = sys.stdout if out is None else out
    # into a pipe or a file rich would assume 80 columns and squeeze the parameters away
    console = Console(file=out, width=None if out.isatty() else 200)
    retry = None
    if watch_every is not None:  # a failing refresh is shown at once, and tried again
        configured = env_float("PREEMPTIBLE_DB_RETRY_TIMEOUT", DEFAULT_RETRY_TIMEOUT)
        retry = min(configured if configured is not None else DEFAULT_RETRY_TIMEOUT, 2.0)
    store = open_store(db, reader=True, retry_timeout=retry)
    busy = False  # a --watch refresh may still be running in its thread at Ctrl+C
    try:
        if sweep_id is None:
            if as_json:
                out.write(json.dumps(sweeps_snapshot(store), indent=1) + "\n")
                return

            def look() -> RenderableType:
                return render_sweeps(sweeps_snapshot(store), width=console.width)

        else:
            if plot is not None:
                doc = snapshot(store, sweep_id)
                plot_timeline(doc, plot)
                print(f"timeline: {plot}", file=sys.stderr)
                if as_json:
                    _dump(doc["sweep"], doc["runs"], out)
                    return
            elif as_json:
                write_json(store, sweep_id, out)
                return
            limit = MAX_ROWS
            if watch_every is not None and out.isatty():  # what fits under the header
                limit = max(10, console.height - 8)

            def look() -> RenderableType:
                doc = table_snapshot(store, sweep_id, limit=limit)
                return render(doc, width=console.width)

        if watch_every is None:
            console.print(look())
            return
        from rich.live import Live

        with Live(console=console, auto_refresh=False) as live:
            busy = True

            def show(view: RenderableType) -> None:
                live.update(view, refresh=True)

            with contextlib.suppress(KeyboardInterrupt):
                watch(look, watch_every, show)
    finally:
        if not busy:
            store.close()


# -- the timeline -----------------------------------------------------------------------------
def plot_timeline(doc: Mapping[str, Any], path: Path) -> Path:
    """Draw the runs' attempts over time into ``path`` (PNG, or any format matplotlib writes,
    by its suffix); written to a temporary file and renamed, so a reader never sees half."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"plot file {str(path)!r}: directory {str(parent)!r} does not exist")
    if path.is_dir():
        raise ConfigError(f"plot file {str(path)!r} is a directory; give a file such as out.png")
    figure = timeline_figure(doc)
    formats = sorted(figure.canvas.get_supported_filetypes())
    kind = path.suffix[1:].lower()
    if kind not in formats:
        raise ConfigError(
            f"plot file {str(path)!r}: cannot write {path.suffix or 'files without a suffix'!r}; "
            f"use a suffix among {', '.join('.' + f for f in formats)}"
        )
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temp, "wb") as out:
            figure.savefig(out, format=kind)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            temp.unlink()
        if isinstance(exc, OSError):
            reason = exc.strerror or str(exc)
            raise ConfigError(f"plot file {str(path)!r}: cannot write: {reason}") from None
        raise
    return path


def timeline_figure(doc: Mapping[str, Any]) -> Figure:
    """The timeline as a matplotlib Figure (Agg canvas, no display). The bars are one
    collection (gid ``attempts``), a box per attempt in the document's order (runs by index,
    attempts by number); the preemption markers are another (gid ``preemptions``)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.collections import PolyCollection
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError(f"the timeline plot needs matplotlib; {PLOT_INSTALL}") from None

    sweep = doc["sweep"]
    runs = sorted(doc["runs"], key=lambda r: r["index"])
    starts = [a["started_at"] for r in runs for a in r["attempt_log"]]
    origin = min(starts) if starts else float(sweep["created_at"])
    ends = [a["started_at"] + a["duration"] - origin for r in runs for a in r["attempt_log"]]
    span = max(ends, default=0.0)
    unit, scale = ("h", 3600.0) if span > 7200 else ("min", 60.0) if span > 120 else ("s", 1.0)

    height = min(40.0, 1.6 + 0.3 * max(len(runs), 3))
    figure = Figure(figsize=(10.0, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    boxes: list[list[tuple[float, float]]] = []
    colours: list[str] = []
    seen: list[str | None] = []
    marks_x: list[float] = []
    marks_y: list[int] = []
    for y, run in enumerate(runs):
        for a in run["attempt_log"]:
            ending = a["ending"]
            x0 = (a["started_at"] - origin) / scale
            x1 = x0 + a["duration"] / scale
            boxes.append([(x0, y - 0.3), (x0, y + 0.3), (x1, y + 0.3), (x1, y - 0.3)])
            colours.append(ENDING_COLOURS.get(ending, "#9467bd"))
            if ending not in seen:
                seen.append(ending)
            if ending == Ending.PREEMPTED or a.get("lost"):
                marks_x.append(x1)
                marks_y.append(y)
    # one collection for all bars: an artist per bar takes seconds for a sweep of 1000 runs
    bars = PolyCollection(
        boxes, facecolors=colours, edgecolors="black", linewidths=0.5, gid="attempts"
    )
    ax.add_collection(bars)
    ax.scatter(marks_x, marks_y, marker="v", s=40, color="black", zorder=3, gid="preemptions")

    step = max(1, math.ceil(len(runs) / _MAX_LABELS))
    ax.set_yticks(range(0, len(runs), step))
    ax.set_yticklabels([runs[i]["run_id"] for i in range(0, len(runs), step)])
    ax.set_ylim(len(runs) - 0.5 if runs else 0.5, -0.5)  # run 0 at the top
    ax.set_xlim(left=0.0, right=max(span / scale, 1.0) * 1.02)
    ax.set_xlabel(f"time since the first attempt ({unit})")
    ax.set_ylabel("run")
    ax.grid(axis="x", alpha=0.3)
    title = f"sweep {sweep['id']}" + (f" ({sweep['name']})" if sweep.get("name") else "")
    ax.set_title(title)
    if not runs or not starts:
        ax.text(0.5, 0.5, "no attempts yet", transform=ax.transAxes, ha="center", va="center")
    order = [e for e in ENDING_COLOURS if e in seen] + [e for e in seen if e not in ENDING_COLOURS]
    handles: list[Any] = [
        Patch(color=ENDING_COLOURS.get(e, "#9467bd"), label=e or "still running") for e in order
    ]
    if marks_x:
        handles.append(
            Line2D([], [], marker="v", color="black", linestyle="none", label="preemption")
        )
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return figure
