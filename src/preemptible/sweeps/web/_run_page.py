"""A run's page (``/run/ID``) and its data (``/api/run/ID``): its parameters and state, every
attempt (how it ended, the checkpoint step it saved, the step the next one resumed from), its
metric curves with those preemptions and resumes marked, and the files its agent keeps under
``--home``: the attempts journal and each attempt's record.

The id in the address is checked (``check_run_id``: a plain name, so it never leaves
``HOME/runs``) and must name a run of the sweep served; anything else is a 404. The files are
read as every reader of run directories reads them (``_paths``): regular files only,
non-blocking, a bounded tail; shown as text, escaped, never interpreted. The page redraws its
``live`` part every ``REFRESH`` seconds from the same page (markup this server drew, put in
place by the script; nothing in it runs).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..._errors import ConfigError
from ..._paths import RunPaths, read_regular, tail_lines
from ..._states import Ending, QueueState
from ..._text import format_age, printable
from ...supervisor._runid import check_run_id
from ..status._render import UNREADABLE, format_params
from ..store._endings import LEASE_EXPIRED
from ..store._queue import Store
from ..store._rows import AttemptRow
from ._html import STATE_COLOURS, escape, shell
from ._svg import Chart, Marker, Series, envelope, render

REFRESH = 2.0
JOURNAL_BYTES = 1 << 16  # the journal's tail shown (a line is ~300 bytes)
MAX_LINE = 2000  # characters of one journal or record line shown
RECORD_BYTES = 1 << 14
MAX_RECORDS = 10  # the newest attempts' records shown
MAX_CURVES = 12  # metrics drawn (the sweep's metric first)
CURVE_POINTS = 400  # a metric's points drawn and in /api/run/ID (a chart is 560 px wide)
CURVE_SIZE = (560, 220)  # a metric's chart: two side by side on a wide screen
_COLOURS = ("#1f77b4", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
_MARK_COLOURS = {"preempted": STATE_COLOURS[QueueState.PREEMPTED], "resumed": "#2ca02c"}


# -- the data ---------------------------------------------------------------------------------
def interruptions(attempts: Sequence[AttemptRow]) -> list[dict[str, Any]]:
    """Where the run was stopped and where it went on, for the curves' markers: each attempt
    that ended PREEMPTED (or otherwise before the last) at the checkpoint step it saved, and
    each later attempt at the step it resumed from, the newest checkpoint step before it
    (none: it started over from step 0)."""
    marks: list[dict[str, Any]] = []
    newest: int | None = None
    for i, a in enumerate(attempts):
        if i > 0:
            step = 0 if newest is None else newest
            how = "started over" if newest is None else "resumed"
            marks.append(
                {
                    "kind": "resumed",
                    "attempt": a.number,
                    "step": step,
                    "label": f"attempt {a.number} {how} from step {step}",
                }
            )
        if a.checkpoint_step is not None:
            newest = a.checkpoint_step if newest is None else max(newest, a.checkpoint_step)
        stopped = a.ending == Ending.PREEMPTED or (
            a.ending not in (None, Ending.FINISHED) and i < len(attempts) - 1
        )
        if stopped and a.checkpoint_step is not None:
            kind = "preempted" if a.ending == Ending.PREEMPTED else "interrupted"
            marks.append(
                {
                    "kind": kind,
                    "attempt": a.number,
                    "step": a.checkpoint_step,
                    "label": f"attempt {a.number} ended {a.ending} at step {a.checkpoint_step}",
                }
            )
    return marks


def _lines(text: str, *, cut: bool) -> list[str]:
    lines = [printable(line) for line in text.splitlines()]
    lines = [line if len(line) <= MAX_LINE else line[: MAX_LINE - 1] + "…" for line in lines]
    return [*lines, "… (cut: the file is longer)"] if cut else lines


def _record(path: Path) -> str | None:
    """An attempt's record as text (indented when it is a JSON object), or None."""
    data = read_regular(path, RECORD_BYTES + 1)
    if data is None:
        return None
    cut = len(data) > RECORD_BYTES
    text = data[:RECORD_BYTES].decode("utf-8", errors="replace")
    if not cut:
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            value = None
        if isinstance(value, dict):
            text = json.dumps(value, indent=1, ensure_ascii=False, default=str)
    return "\n".join(_lines(text, cut=cut))


def _files(home: Path, run_id: str, numbers: Sequence[int]) -> dict[str, Any]:
    paths = RunPaths.under(home, run_id)
    journal = tail_lines(paths.journal, JOURNAL_BYTES)
    return {
        "run_dir": str(paths.run_dir),
        "journal": [printable(line)[:MAX_LINE] for line in journal],
        "records": [
            {"attempt": n, "text": _record(paths.record(n))} for n in list(numbers)[-MAX_RECORDS:]
        ],
    }


History = Mapping[str, Sequence[tuple[int, float, int]]]  # Store.run_history: name -> points


def _segments(points: Sequence[tuple[int, float, int]]) -> list[list[tuple[int, float, int]]]:
    """``points`` (by step) cut where the attempt that reported them changes."""
    out: list[list[tuple[int, float, int]]] = []
    for p in points:
        if out and out[-1][-1][2] == p[2]:
            out[-1].append(p)
        else:
            out.append([p])
    return out


def thin(points: Sequence[tuple[int, float, int]]) -> list[tuple[int, float, int]]:
    """A metric's points (by step), each attempt's part thinned by ``envelope`` to its share
    of ``CURVE_POINTS`` (at least its first, lowest, highest and last point), so that where one
    attempt ends and the next begins stays exact however long the history."""
    if len(points) <= CURVE_POINTS:
        return list(points)
    return [
        p
        for part in _segments(points)
        for p in envelope(part, max(4, CURVE_POINTS * len(part) // len(points)))
    ]


def curves(history: History, metric: str | None) -> dict[str, Any]:
    """The metrics drawn (``MAX_CURVES`` of them: the sweep's metric first, then by name), each
    with its count of reports and its points thinned (``thin``), non-finite values left out;
    and how many metrics the run reported."""
    names = sorted(history, key=lambda n: (n != metric, n))
    drawn: dict[str, Any] = {}
    for name in names[:MAX_CURVES]:
        points = sorted(
            ((int(st), float(v), int(a)) for st, v, a in history[name] if math.isfinite(v)),
            key=lambda p: p[0],
        )
        drawn[name] = {"count": len(points), "points": thin(points)}
    return {"metrics": len(names), "drawn": drawn}


def _curves(store: Store, run_id: str, metric: str | None) -> dict[str, Any]:
    return curves(store.run_history(run_id), metric)


def run_document(
    store: Store,
    *,
    sweep_id: str,
    run_id: str,
    home: Path,
    metric: str | None,
    now: float | None = None,
) -> dict[str, Any] | None:
    """What ``/api/run/ID`` answers; None when ``run_id`` is not a run id (``check_run_id``:
    nothing is read for it) or names no run of the sweep ``sweep_id``."""
    at = time.time() if now is None else now
    try:
        check_run_id(run_id, "the address")
        run = store.run(run_id)
    except ConfigError:  # not a plain name, or no such run
        return None
    if run.sweep_id != sweep_id:
        return None
    attempts = store.attempts(run_id)
    steps = [a.checkpoint_step for a in attempts if a.checkpoint_step is not None]
    newest = attempts[-1] if attempts else None
    return {
        "run_id": run.id,
        "sweep_id": run.sweep_id,
        "index": run.index,
        "state": run.state,
        "attempts": run.attempt,
        "preemptions": run.preemptions,
        "failures": run.failures,
        "params": None if "params" in run.unreadable else run.params,
        "summary": run.summary,
        "unreadable": list(run.unreadable),
        "checkpoint_step": steps[-1] if steps else None,
        "agent": newest.agent if newest else run.lease_owner,
        "host": newest.host if newest else run.lease_host,
        "heartbeat_age": max(0.0, at - run.updated_at) if run.state == QueueState.RUNNING else None,
        "created_at": run.created_at,
        "attempt_log": [
            {
                "number": a.number,
                "agent": a.agent,
                "host": a.host,
                "started_at": a.started_at,
                "ended_at": a.ended_at,
                "ending": a.ending,
                "outcome": a.outcome,
                "exit_code": a.exit_code,
                "duration": a.duration
                if a.duration is not None
                else max(0.0, (a.ended_at or at) - a.started_at),
                "checkpoint_step": a.checkpoint_step,
                "lost": a.closed_by == LEASE_EXPIRED,
                "late": a.late,  # it ended after another agent took the run over
            }
            for a in attempts
        ],
        "marks": interruptions(attempts),
        "curves": _curves(store, run_id, metric),
        "files": _files(home, run_id, [a.number for a in attempts]),
        "now": at,
    }


def _attempt_colour(attempt: int) -> str:
    return _COLOURS[(attempt - 1) % len(_COLOURS)]


def _markers(marks: Sequence[Mapping[str, Any]]) -> list[Marker]:
    """A line at each mark: a stop labelled on its left, a resume on its right (a run resumed
    from the step it was preempted at has both on one line)."""
    out = []
    for m in marks:
        step = m["step"]
        if m["kind"] == "resumed":
            text, left = f"attempt {m['attempt']} from {step}", False
        else:
            text, left = f"{m['kind']} at {step}", True
        colour = _MARK_COLOURS.get(m["kind"], "#d62728")
        out.append(Marker(step, m["label"], m["kind"], colour, text=text, left=left))
    return out


def curve_chart(name: str, curve: Mapping[str, Any], marks: Sequence[Mapping[str, Any]]) -> str:
    """One metric's chart: a line per attempt's part of it, coloured by attempt, with the
    run's stops and resumes (``interruptions``) marked and labelled."""
    shown, count = len(curve["points"]), curve["count"]
    title = f"{name} ({count} reports" + (f", {shown} points drawn)" if shown < count else ")")
    series = [
        Series(
            f"attempt {part[0][2]}",
            [(p[0], p[1]) for p in part],
            _attempt_colour(part[0][2]),
            attempt=part[0][2],
        )
        for part in _segments([tuple(p) for p in curve["points"]])
    ]
    chart = Chart(title, "step", name, series, _markers(marks))
    return render(chart, width=CURVE_SIZE[0], height=CURVE_SIZE[1])


def curve_charts(doc: Mapping[str, Any]) -> list[str]:
    """One chart per metric drawn (``curves``), each in a figure named by its metric."""
    return [
        f'<figure class="curve" data-metric="{escape(name)}">'
        f"{curve_chart(name, curve, doc['marks'])}</figure>"
        for name, curve in doc["curves"]["drawn"].items()
    ]


# -- the page ---------------------------------------------------------------------------------
_JS = """
async function refresh() {
  try {
    const r = await fetch(location.pathname + '?part=live', {cache: 'no-store'});
    if (r.ok) {
      const page = new DOMParser().parseFromString(await r.text(), 'text/html');
      const fresh = page.getElementById('live');
      const open = new Set([...document.querySelectorAll('details[open]')].map((d) => d.id));
      if (fresh) {
        document.getElementById('live').replaceWith(document.importNode(fresh, true));
        for (const d of document.querySelectorAll('details')) d.open = open.has(d.id);
      }
      document.getElementById('status').textContent = 'updated ' +
        new Date().toLocaleTimeString();
    }
  } catch (e) {
    document.getElementById('status').textContent = 'unreachable (' + e.message + ')';
  } finally {
    setTimeout(refresh, %(refresh)d);
  }
}
setTimeout(refresh, %(refresh)d);
"""


def _clock(at: float | None) -> str:
    return "-" if at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def _facts(doc: Mapping[str, Any]) -> str:
    extra = [f"{doc['preemptions']} preempted"] if doc["preemptions"] else []
    extra += [f"{doc['failures']} failed"] if doc["failures"] else []
    params = doc["params"]
    summary = doc["summary"]
    rows = [
        ("state", f'<span class="s-{escape(doc["state"])}">{escape(doc["state"])}</span>'),
        ("attempts", escape(f"{doc['attempts']}" + (f" ({', '.join(extra)})" if extra else ""))),
        (
            "checkpoint step",
            escape("-" if doc["checkpoint_step"] is None else doc["checkpoint_step"]),
        ),
        ("params", escape(UNREADABLE if params is None else format_params(params) or "-")),
        ("reported", escape(format_params(summary) if summary else "-")),
        ("agent@host", escape(f"{doc['agent']}@{doc['host']}" if doc["agent"] else "-")),
    ]
    if doc["heartbeat_age"] is not None:
        rows.append(("heartbeat", escape(format_age(doc["heartbeat_age"]) + " ago")))
    rows.append(("created", escape(_clock(doc["created_at"]))))
    cls = {"params": ' class="params"', "reported": ' class="params"'}
    items = "".join(f"<dt>{k}</dt><dd{cls.get(k, '')}>{v}</dd>" for k, v in rows)
    return f'<dl class="run">{items}</dl>'


def _attempts(doc: Mapping[str, Any]) -> str:
    marks = {(m["attempt"], m["kind"]): m["step"] for m in doc["marks"]}
    head = ("attempt", "agent@host", "started", "end", "duration", "ending", "exit", "ckpt step")
    rows = []
    for a in doc["attempt_log"]:
        ending = a["ending"] or "(still running)"
        if a["lost"]:
            ending += " (lease lost)"
        elif a.get("late"):
            ending += " (late: after a takeover)"
        resumed = marks.get((a["number"], "resumed"))
        number = f"{a['number']}" + ("" if resumed is None else f" (from step {resumed})")
        cells = (
            number,
            f"{a['agent']}@{a['host']}",
            _clock(a["started_at"]),
            _clock(a["ended_at"]),
            format_age(a["duration"]),
            ending,
            "-" if a["exit_code"] is None else str(a["exit_code"]),
            "-" if a["checkpoint_step"] is None else str(a["checkpoint_step"]),
        )
        tds = "".join(f"<td>{escape(c)}</td>" for c in cells)
        rows.append(
            f'<tr class="ending-{escape(a["ending"])}" data-attempt="{a["number"]}">{tds}</tr>'
        )
    if not rows:
        rows.append(f'<tr><td colspan="{len(head)}">not started yet</td></tr>')
    ths = "".join(f"<th>{h}</th>" for h in head)
    return (
        f'<table id="attempts"><thead><tr>{ths}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )


def _pre(lines: Sequence[str]) -> str:
    return "<pre>" + "\n".join(escape(line) for line in lines) + "</pre>"


def _file_parts(doc: Mapping[str, Any]) -> str:
    files = doc["files"]
    where = files["run_dir"]
    journal = files["journal"]
    out = [f'<h2>attempts journal</h2><div class="note">{escape(where)}/attempts.jsonl</div>']
    out.append(
        _pre(journal)
        if journal
        else '<div class="note">no journal here (the agent\'s files are under its --home; '
        "give status --serve the same --home)</div>"
    )
    out.append("<h2>records</h2>")
    for i, r in enumerate(reversed(files["records"])):
        n = r["attempt"]
        body = _pre(r["text"].splitlines()) if r["text"] is not None else "<div>none</div>"
        shown = " open" if i == 0 else ""  # the newest (the script keeps what the reader chose)
        out.append(
            f'<details id="record-{n}"{shown}><summary>attempt {n}: attempt-{n}/record.json'
            f"</summary>{body}</details>"
        )
    if not files["records"]:
        out.append('<div class="note">no attempt yet</div>')
    return "".join(out)


def render_live(doc: Mapping[str, Any]) -> str:
    """The part of the run's page that its script redraws (``/run/ID?part=live``)."""
    charts = curve_charts(doc)
    total = doc["curves"]["metrics"]
    drawn = (
        ""
        if total <= len(charts)
        else f'<div class="note" id="curves-more">{len(charts)} of the {total} metrics drawn '
        "(the sweep's metric first, then by name)</div>"
    )
    curves = "".join(charts) if charts else '<div class="note">no metrics reported yet</div>'
    return (
        f'<div id="live">{_facts(doc)}<h2>metrics</h2>{drawn}<div id="curves">{curves}</div>'
        f"<h2>attempts</h2>{_attempts(doc)}{_file_parts(doc)}</div>"
    )


def render_run_page(doc: Mapping[str, Any], *, nonce: str) -> str:
    body = (
        f'<div><a href="/">sweep {escape(doc["sweep_id"])}</a></div>'
        f"<h1>run {escape(doc['run_id'])}</h1>"
        f'<div id="status"></div>{render_live(doc)}'
    )
    return shell(f"run {doc['run_id']}", body, _JS % {"refresh": int(REFRESH * 1000)}, nonce)
