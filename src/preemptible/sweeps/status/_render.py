"""The tables of ``preemptible status``, drawn with rich from a document of ``_snapshot``:
the sweeps in a database (``render_sweeps``), or one sweep's header line and runs (``render``).
An unreadable field of the document is shown "(unreadable)"."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rich.cells import cell_len
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..._states import QueueState
from ..._text import format_age, printable

STATE_STYLES = {
    QueueState.FINISHED: "green",
    QueueState.RUNNING: "blue",
    QueueState.PENDING: "dim",
    QueueState.PREEMPTED: "yellow",
    QueueState.CRASHED: "yellow",
    QueueState.FAILED: "red",
    QueueState.KILLED: "red",
    QueueState.CANCELLED: "grey50",
    QueueState.STOPPED: "magenta",
}
UNREADABLE = "(unreadable)"
_VALUE_WIDTH = 24  # a parameter value longer than this is shortened


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
    target = sweep.get("target")
    if target and target.get("run_id") and metric:
        text.append(
            printable(
                f" · target {metric['name']}={target['value']:g} reached by {target['run_id']} "
                f"({target['metric']:.6g}): no new runs"
            ),
            style="bold",
        )
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
    return printable(" ".join(f"{key}={_cell(value)}" for key, value in _flatten(params, "")))


def _flatten(params: Mapping[str, Any], prefix: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in params.items():
        if isinstance(value, Mapping) and value:
            out.extend(_flatten(value, f"{prefix}{key}."))
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _cell(value: Any) -> str:
    """A parameter value as a short one-line table cell."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, float):
        text = f"{value:.6g}"
    else:
        text = json.dumps(value, separators=(",", ":"))
    text = " ".join(text.split())  # one line
    return text if len(text) <= _VALUE_WIDTH else text[: _VALUE_WIDTH - 1] + "…"
