"""What ``preemptible status`` shows: one document read from the queue, drawn three ways.

``snapshot`` reads a sweep once into plain JSON data (``--json`` prints exactly that), and
``render`` and ``plot_timeline`` draw only from that document, so the table, the JSON and the
plot always agree and the drawing code can be tested without a database.

Times in the document are unix seconds from the database clock; ages and running durations
are relative to ``now`` (this host's clock unless given). For SQLite both clocks are the same
host's; against PostgreSQL a skewed client clock shifts the ages, and they are clamped at 0.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from .._errors import ConfigError
from ._spec import GOALS
from ._store import LEASE_EXPIRED, AttemptRow, RunRow, Store, SweepRow, _metric, printable

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STATES = (
    *("PENDING", "RUNNING", "FINISHED", "PREEMPTED"),
    *("FAILED", "CRASHED", "KILLED", "CANCELLED"),
)
STATE_STYLES = {
    "FINISHED": "green",
    "RUNNING": "blue",
    "PENDING": "dim",
    "PREEMPTED": "yellow",
    "CRASHED": "yellow",
    "FAILED": "red",
    "KILLED": "red",
    "CANCELLED": "grey50",
}
# Bar colours of the timeline by how the attempt ended (None: still running).
ENDING_COLOURS: dict[str | None, str] = {
    "FINISHED": "#2ca02c",
    "PREEMPTED": "#ffbf00",
    "CRASHED": "#ff7f0e",
    "FAILED": "#d62728",
    "KILLED": "#8c1c13",
    "CANCELLED": "#7f7f7f",
    "RELEASED": "#c7c7c7",
    None: "#1f77b4",
}
PLOT_INSTALL = "pip install 'preemptible[plot]'"
_VALUE_WIDTH = 24  # a parameter value longer than this is shortened
_MAX_LABELS = 50  # the timeline labels at most this many runs on its y axis


# -- the document -----------------------------------------------------------------------------
def snapshot(store: Store, sweep_id: str, *, now: float | None = None) -> dict[str, Any]:
    """The sweep and every run with its attempts, as JSON data (the ``--json`` document)."""
    at = time.time() if now is None else now
    sweep = store.sweep(sweep_id)
    runs = store.runs(sweep_id)
    metric = _metric_spec(sweep.spec)
    name = metric["name"] if metric else None
    return {
        "sweep": _sweep_doc(sweep, runs),
        "runs": [_run_doc(run, store.attempts(run.id), name, at) for run in runs],
    }


def sweeps_snapshot(store: Store) -> list[dict[str, Any]]:
    """One summary per sweep in the database, oldest first (``status`` without a sweep id)."""
    return [_sweep_doc(sweep, store.runs(sweep.id)) for sweep in store.sweeps()]


def _metric_spec(spec: Mapping[str, Any]) -> dict[str, str] | None:
    """The spec's metric, read leniently: a stored spec is shown as it is, valid or not."""
    metric = spec.get("metric")
    if not isinstance(metric, Mapping) or not isinstance(metric.get("name"), str):
        return None
    goal = metric.get("goal")
    return {"name": metric["name"], "goal": goal if goal in GOALS else "minimize"}


def _sweep_doc(sweep: SweepRow, runs: Sequence[RunRow]) -> dict[str, Any]:
    metric = _metric_spec(sweep.spec)
    counts = dict.fromkeys(STATES, 0)
    for run in runs:
        counts[run.state] = counts.get(run.state, 0) + 1
    best = None
    if metric is not None:
        # the best final result: a finished run's last reported value (running runs report
        # intermediate values, shown in their own rows)
        sign = -1.0 if metric["goal"] == "maximize" else 1.0
        scored = [
            (sign * value, run.index, run.id, value)
            for run in runs
            if run.state == "FINISHED"
            and (value := _metric(run.summary, metric["name"])) is not None
        ]
        if scored:
            _, _, run_id, value = min(scored)
            best = {"run_id": run_id, "metric": value}
    method = sweep.spec.get("method")
    return {
        "id": sweep.id,
        "name": sweep.name,
        "control": sweep.control,
        "method": method if isinstance(method, str) else None,
        "metric": metric,
        "run_cap": sweep.run_cap,
        "runs_created": sweep.runs_created,
        "counts": counts,
        "best": best,
        "created_at": sweep.created_at,
    }


def _run_doc(
    run: RunRow, attempts: Sequence[AttemptRow], metric: str | None, now: float
) -> dict[str, Any]:
    log = [_attempt_doc(a, now) for a in attempts]
    steps = [a.checkpoint_step for a in attempts if a.checkpoint_step is not None]
    newest = attempts[-1] if attempts else None
    heartbeat_age = None
    if run.state == "RUNNING":
        # updated_at of a RUNNING run is its last claim, heartbeat or relayed report: each is
        # the lease holder showing it is alive (the lease length itself is not stored)
        heartbeat_age = max(0.0, now - run.updated_at)
    return {
        "run_id": run.id,
        "index": run.index,
        "params": run.params,
        "state": run.state,
        "attempts": run.attempt,
        "preemptions": run.preemptions,
        "failures": run.failures,
        "checkpoint_step": steps[-1] if steps else None,
        "metric": _metric(run.summary, metric),
        "summary": run.summary,
        "agent": newest.agent if newest else run.lease_owner,
        "host": newest.host if newest else run.lease_host,
        "heartbeat_age": heartbeat_age,
        "duration": math.fsum(a["duration"] for a in log),
        "attempt_log": log,
    }


def _attempt_doc(a: AttemptRow, now: float) -> dict[str, Any]:
    if a.duration is not None:
        duration = a.duration
    else:  # running (elapsed so far), or ended without a measure (lease lost, released)
        duration = max(0.0, (a.ended_at if a.ended_at is not None else now) - a.started_at)
    return {
        "number": a.number,
        "agent": a.agent,
        "host": a.host,
        "started_at": a.started_at,
        "ended_at": a.ended_at,
        "ending": a.ending,
        "lost": a.closed_by == LEASE_EXPIRED,
        "exit_code": a.exit_code,
        "duration": duration,
        "checkpoint_step": a.checkpoint_step,
    }


# -- the table --------------------------------------------------------------------------------
# Every text in the table comes from the queue, which any agent, run or spec writes: a name or
# a value with an escape sequence must not drive the terminal, so control characters are shown
# escaped (``\x1b``), as ``repr`` would (``--json`` is JSON, escaped by ``json.dumps``).
def _text(value: object, style: str = "") -> Text:
    return Text(printable(str(value)), style=style)


def render(doc: Mapping[str, Any], *, now: float | None = None) -> Group:
    """A header line about the sweep, then one row per run in index order."""
    sweep = doc["sweep"]
    metric = sweep.get("metric")
    best = sweep.get("best") or {}
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("run", no_wrap=True)
    table.add_column("params", overflow="fold", ratio=1)
    table.add_column("state", no_wrap=True)
    table.add_column("attempts", no_wrap=True)
    table.add_column("ckpt step", justify="right", no_wrap=True)
    if metric:
        arrow = "↑" if metric.get("goal") == "maximize" else "↓"
        # a Text header: a metric name is the user's text, never rich markup
        table.add_column(_text(f"{metric['name']} {arrow}"), justify="right", no_wrap=True)
    else:
        table.add_column("metric", justify="right", no_wrap=True)
    table.add_column("agent@host", overflow="fold")
    table.add_column("heartbeat", justify="right", no_wrap=True)
    table.add_column("duration", justify="right", no_wrap=True)
    runs = sorted(doc["runs"], key=lambda r: r["index"])
    for run in runs:
        state = run["state"]
        value = run.get("metric")
        shown = Text("-" if value is None else f"{value:.6g}")
        if run["run_id"] == best.get("run_id"):
            shown.stylize("bold")
        extra = [f"{n}{c}" for n, c in ((run["preemptions"], "p"), (run["failures"], "f")) if n]
        attempts = str(run["attempts"]) + (f" ({' '.join(extra)})" if extra else "")
        step = run.get("checkpoint_step")
        where = f"{run['agent']}@{run['host']}" if run.get("agent") else "-"
        table.add_row(
            _text(run["run_id"]),
            _text(format_params(run["params"])),
            _text(state, STATE_STYLES.get(state, "")),
            _text(attempts),
            _text("-" if step is None else step),
            shown,
            _text(where),
            _text(format_age(run.get("heartbeat_age"))),
            _text(format_age(run.get("duration") if run["attempts"] else None)),
        )
    if not runs:
        table.caption = "no runs yet"
    return Group(_header(sweep, time.time() if now is None else now), table)


def _header(sweep: Mapping[str, Any], now: float) -> Text:
    text = Text()
    text.append(printable(f"sweep {sweep['id']}"), style="bold")
    if sweep.get("name"):
        text.append(printable(f" {sweep['name']!r}"))
    text.append(printable(f" · {sweep['control']}"))
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


def render_sweeps(rows: Sequence[Mapping[str, Any]]) -> Table:
    """One row per sweep (``sweeps_snapshot``)."""
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    for name in ("sweep", "name", "control", "method", "metric", "runs", "states", "best"):
        table.add_column(name, overflow="fold")
    table.add_column("created", no_wrap=True)
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
        table.add_row(
            _text(row["id"]),
            _text(row.get("name") or "-"),
            _text(row["control"]),
            _text(row.get("method") or "-"),
            _text(f"{metric['goal']} {metric['name']}" if metric else "-"),
            _text(f"{row['runs_created']}{'' if cap is None else f'/{cap}'}"),
            states if states else Text("-"),
            _text(f"{best['run_id']} {best['metric']:.6g}" if best else "-"),
            _text(created),
        )
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


def format_age(seconds: float | None) -> str:
    """``42s``, ``3m12s``, ``2h05m``, ``3d04h``; ``-`` for none."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


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
            if ending == "PREEMPTED" or a.get("lost"):
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
        Patch(color=ENDING_COLOURS.get(e, "#9467bd"), label=e or "running") for e in order
    ]
    if marks_x:
        handles.append(
            Line2D([], [], marker="v", color="black", linestyle="none", label="preemption")
        )
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return figure
