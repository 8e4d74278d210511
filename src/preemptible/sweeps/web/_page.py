"""The sweep's page (``/``) and its data (``/api/sweep``): the header, the counts as state
filters, one page of the runs table, the best run and the best-so-far chart (``/best.svg``).

The table shows ``PAGE_ROWS`` runs at a time, by index, of the states the query names
(``?state=RUNNING&state=FAILED&page=2``; none: every run), so a filtered page is a link;
under it, the timeline of those runs' attempts (``/timeline.svg``, same query). The script
redraws the table from ``/api/sweep`` every ``REFRESH`` seconds with the same query; it sets
text only, and puts the charts in place again from ``/best.svg`` (when the runs changed) and
``/timeline.svg`` (every 5 refreshes): markup this server drew, never the queue's text
unescaped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from ..._text import format_age, printable
from ..status._render import UNREADABLE, _header_line, format_params
from ..status._snapshot import STATES
from ..store._queue import Store
from ._html import counts_of, escape, query_of, shell
from ._model import PAGE_ROWS, SweepModel
from ._svg import Chart, Marker, Series, render
from ._timeline_svg import timeline_svg

REFRESH = 2.0  # seconds between the page's reads of /api/sweep
COLUMNS = ("run", "state", "attempt", "params", "metric", "ckpt step", "age", "agent@host")


# -- the data ---------------------------------------------------------------------------------
def _age(run: Mapping[str, Any], now: float) -> float | None:
    """Seconds since the run last showed a sign: its heartbeat while RUNNING, else the end (or
    start) of its newest attempt; None for a run never claimed."""
    if run.get("heartbeat_age") is not None:
        return float(run["heartbeat_age"])
    log = run.get("attempt_log") or ()
    if not log:
        return None
    last = log[-1]
    at = last["ended_at"] if last["ended_at"] is not None else last["started_at"]
    return max(0.0, now - float(at))


def _cells(run: Mapping[str, Any], age: float | None) -> list[str]:
    """The texts of the run's row, in ``COLUMNS`` order (printable: no control characters)."""
    params = run.get("params")
    value = run.get("metric")
    extra = [f"{n}{c}" for n, c in ((run["preemptions"], "p"), (run["failures"], "f")) if n]
    step = run.get("checkpoint_step")
    return [
        printable(str(run["run_id"])),
        run["state"],
        str(run["attempts"]) + (f" ({' '.join(extra)})" if extra else ""),
        UNREADABLE if params is None else format_params(params),
        "-" if value is None else f"{value:.6g}",
        "-" if step is None else str(step),
        format_age(age),
        printable(f"{run['agent']}@{run['host']}") if run.get("agent") else "-",
    ]


def sweep_document(
    model: SweepModel,
    store: Store,
    *,
    states: frozenset[str] = frozenset(),
    page: int = 1,
    now: float | None = None,
) -> dict[str, Any]:
    """What ``/api/sweep`` answers: the sweep's header line and document, the counts by
    state, the best run, and page ``page`` of the runs in ``states`` (a page past the last is
    the last) with the cells the table shows. ``chart`` changes whenever the runs do."""
    at = time.time() if now is None else now
    model.refresh(store)
    agg = model.aggregate()
    ids = model.matching(states)
    pages = max(1, -(-len(ids) // PAGE_ROWS))
    page = min(page, pages)
    first = (page - 1) * PAGE_ROWS
    runs = []
    for run in model.page_docs(store, ids[first : first + PAGE_ROWS], at):
        age = _age(run, at)
        runs.append(
            {
                "run_id": run["run_id"],
                "index": run["index"],
                "state": run["state"],
                "attempt": run["attempts"],
                "preemptions": run["preemptions"],
                "params": run["params"],
                "metric": run["metric"],
                "checkpoint_step": run["checkpoint_step"],
                "age": age,
                "agent": run["agent"],
                "host": run["host"],
                "attempt_log": [  # as in --json, less what the timeline does not draw
                    {k: a[k] for k in ("number", "started_at", "ended_at", "ending", "lost")}
                    for a in run["attempt_log"]
                ],
                "cells": _cells(run, age),
            }
        )
    best = (
        None if agg.best is None else {"run_id": agg.best["run_id"], "metric": agg.best["metric"]}
    )
    sweep = {**model.head, "counts": agg.counts, "best": best}
    return {
        "sweep": {k: v for k, v in sweep.items() if k != "unreadable"},
        "header": _header_line(sweep, at).plain,
        "database": store.display,
        "now": at,
        "counts": agg.counts,
        "filter": [s for s in STATES if s in states],
        "page": {
            "number": page,
            "pages": pages,
            "size": PAGE_ROWS,
            "matching": len(ids),
            "first": first + 1 if runs else 0,
            "last": first + len(runs),
        },
        "runs": runs,
        "best": best,
        "chart": model.version,
    }


def best_chart(model: SweepModel) -> str:
    """The best-so-far chart of the sweep's finished runs, by run index (``/best.svg``)."""
    agg = model.aggregate()
    metric = model.head.get("metric")
    name = metric["name"] if metric else "metric"
    goal = metric["goal"] if metric else "minimize"
    dots = "finished runs" + (" (lowest and highest per range)" if agg.binned else "")
    markers = []
    if agg.best is not None:
        best = agg.best
        label = f"best: run {best['run_id']} {name}={best['metric']:.6g}"
        markers.append(Marker(best["index"], label, "best", "#2ca02c", dashed=False))
    chart = Chart(
        title=f"best {name} so far ({goal}, {agg.finished} finished runs)",
        x_label="run index",
        y_label=name,
        series=[
            Series(dots, agg.dots, "#9ab", "dots"),
            Series("best so far", agg.steps, "#d62728", "step"),
        ],
        markers=markers,
        chart_id="best-chart",
    )
    return render(chart)


# -- the page ---------------------------------------------------------------------------------
# Only text is ever set (textContent), and markup only as this server drew it (the chart).
_JS = """
const COLS = %(columns)s;
let downSince = null, chartKey = %(chart)s, timer = null, asked = 0;
function text(el, value) { el.textContent = value; }
function byId(id) { return document.getElementById(id); }
function runLink(id) {
  const a = document.createElement('a');
  a.href = '/run/' + encodeURIComponent(id);
  text(a, id);
  return a;
}
function queryFor(page) {
  const q = new URLSearchParams(location.search);
  q.delete('page');
  if (page > 1) q.set('page', page);
  const s = q.toString();
  return s ? '?' + s : location.pathname;
}
function draw(d) {
  text(byId('header'), d.header);
  for (const [state, n] of Object.entries(d.counts)) {
    const c = byId('count-' + state);
    if (c) text(c, n);
  }
  const rows = [];
  for (const run of d.runs) {
    const tr = document.createElement('tr');
    tr.dataset.run = run.run_id;
    tr.dataset.state = run.state;
    run.cells.forEach((cell, i) => {
      const td = document.createElement('td');
      td.className = COLS[i] === 'state' ? 'state s-' + run.state : COLS[i].replace(/\\W/g, '');
      if (i === 0) td.appendChild(runLink(cell)); else text(td, cell);
      tr.appendChild(td);
    });
    rows.push(tr);
  }
  byId('runs').replaceChildren(...rows);
  const p = d.page;
  const shown = d.filter.length ? ' ' + d.filter.join(' or ') : '';
  text(byId('pageinfo'), p.matching ? 'runs ' + p.first + '-' + p.last + ' of ' + p.matching +
    shown + ' (page ' + p.number + ' of ' + p.pages + ')' : 'no' + shown + ' runs yet');
  const prev = byId('prev'), next = byId('next');
  prev.hidden = p.number <= 1;
  prev.href = queryFor(p.number - 1);
  next.hidden = p.number >= p.pages;
  next.href = queryFor(p.number + 1);
  const best = byId('best');
  if (d.best) {
    const metric = d.sweep.metric ? d.sweep.metric.name : 'metric';
    const label = document.createElement('span');
    text(label, ' ' + metric + '=' + Number(d.best.metric).toPrecision(6));
    best.replaceChildren('best: ', runLink(d.best.run_id), label);
  } else {
    text(best, 'best: no finished run with a metric yet');
  }
  if (d.chart !== chartKey) { chartKey = d.chart; loadChart(); }
}
async function refresh() {
  clearTimeout(timer);
  const mine = ++asked;
  const status = byId('status');
  try {
    const r = await fetch('/api/sweep' + location.search, {cache: 'no-store'});
    const d = await r.json();
    if (!r.ok) throw new Error(d.error || ('HTTP ' + r.status));
    if (mine !== asked) return;  // a newer request (the filters changed) draws instead
    draw(d);
    downSince = null;
    status.className = '';
    text(status, 'updated ' + new Date().toLocaleTimeString());
  } catch (e) {
    if (mine !== asked) return;
    if (downSince === null) downSince = new Date();
    status.className = 'down';
    text(status, 'unreachable since ' + downSince.toLocaleTimeString() +
      ', showing the last table (' + e.message + ')');
  } finally {
    if (mine === asked) timer = setTimeout(refresh, %(refresh)d);
  }
}
const form = byId('filters');
function boxes() { return form.querySelectorAll('input[name=state]'); }
form.addEventListener('submit', (e) => e.preventDefault());
form.addEventListener('change', () => {
  const q = new URLSearchParams();
  for (const box of boxes()) if (box.checked) q.append('state', box.value);
  const s = q.toString();
  history.pushState(null, '', s ? '?' + s : location.pathname);
  refresh();
});
window.addEventListener('popstate', () => {
  const chosen = new URLSearchParams(location.search).getAll('state')
    .flatMap((v) => v.split(',')).map((v) => v.trim().toUpperCase());
  for (const box of boxes()) box.checked = chosen.includes(box.value);
  refresh();
});
for (const button of form.querySelectorAll('button')) button.hidden = true;
async function loadSvg(url, id) {
  const r = await fetch(url, {cache: 'no-store'});
  if (!r.ok) return;
  const doc = new DOMParser().parseFromString(await r.text(), 'image/svg+xml');
  const svg = doc.documentElement;
  if (svg.namespaceURI === 'http://www.w3.org/2000/svg' && svg.id === id) {
    byId(id).replaceWith(document.importNode(svg, true));
  }
}
function loadChart() { return loadSvg('/best.svg', 'best-chart'); }
setInterval(() => loadSvg('/timeline.svg' + location.search, 'timeline'), %(timeline_every)d);
timer = setTimeout(refresh, %(refresh)d);
"""


def _css_name(column: str) -> str:
    """The class of a column's cells (as the script names them: no spaces or ``@``)."""
    return "".join(c for c in column if c.isalnum() or c == "_")


def _pager(doc: Mapping[str, Any] | None, states: frozenset[str]) -> str:
    page = (doc or {}).get("page") or {"number": 1, "pages": 1, "matching": 0}
    shown = " " + " or ".join(s for s in STATES if s in states) if states else ""
    if page["matching"]:
        info = (
            f"runs {page['first']}-{page['last']} of {page['matching']}{shown} "
            f"(page {page['number']} of {page['pages']})"
        )
    else:
        info = f"no{shown} runs yet"
    prev = "" if page["number"] > 1 else " hidden"
    nxt = "" if page["number"] < page["pages"] else " hidden"
    back = query_of(states, page["number"] - 1) or "/"
    on = query_of(states, page["number"] + 1)
    return (
        f'<div id="pager"><span id="pageinfo">{escape(info)}</span>'
        f'<a id="prev" href="{escape(back)}"{prev}>previous {PAGE_ROWS}</a>'
        f'<a id="next" href="{escape(on)}"{nxt}>next {PAGE_ROWS}</a></div>'
    )


def _filters(counts: Mapping[str, int], states: frozenset[str]) -> str:
    boxes = "".join(
        f'<label class="c-{escape(s)}"><input type="checkbox" name="state" value="{escape(s)}"'
        f"{' checked' if s in states else ''}>"
        f'<span id="count-{escape(s)}">{counts.get(s, 0)}</span>'
        f" {escape(s)}</label>"
        for s in STATES
    )
    return (
        f'<form id="filters" method="get" action="/">{boxes}'
        '<button type="submit">show these states</button> <a href="/">all runs</a></form>'
    )


def _best(doc: Mapping[str, Any] | None) -> str:
    best = (doc or {}).get("best")
    if not best:
        return '<div id="best">best: no finished run with a metric yet</div>'
    metric = (doc or {}).get("sweep", {}).get("metric")
    name = metric["name"] if metric else "metric"
    run = best["run_id"]
    return (
        f'<div id="best">best: <a href="/run/{escape(run)}">{escape(run)}</a>'
        f"<span> {escape(name)}={best['metric']:.6g}</span></div>"
    )


def render_page(
    doc: Mapping[str, Any] | None,
    error: str | None,
    *,
    nonce: str,
    chart: str,
    states: frozenset[str] = frozenset(),
) -> str:
    """The page: ``doc`` (``sweep_document``) drawn on the server, or ``error`` in its place;
    ``chart``: the best-so-far chart (``best_chart``), then the table and its runs' attempts
    timeline (``timeline_svg``)."""
    rows = []
    for run in (doc or {}).get("runs", ()):
        classes = [f"state s-{run['state']}" if c == "state" else _css_name(c) for c in COLUMNS]
        cells = [escape(cell) for cell in run["cells"]]
        cells[0] = f'<a href="/run/{escape(run["run_id"])}">{cells[0]}</a>'
        tds = "".join(
            f'<td class="{escape(k)}">{cell}</td>' for k, cell in zip(classes, cells, strict=True)
        )
        state = escape(run["state"])
        rows.append(f'<tr data-run="{escape(run["run_id"])}" data-state="{state}">{tds}</tr>')
    title = f"sweep {doc['sweep']['id']}" if doc else "sweep"
    status = (
        f'<div id="status" class="down">{escape(error)}</div>' if error else '<div id="status">'
    )
    status += "" if error else "</div>"
    script = _JS % {
        "columns": json.dumps(list(COLUMNS)),
        "chart": json.dumps(doc["chart"] if doc else None),
        "refresh": int(REFRESH * 1000),
        "timeline_every": int(5 * REFRESH * 1000),
    }
    body = (
        f"<h1>{escape(title)}</h1>"
        f'<div id="header">{escape(doc["header"] if doc else "")}</div>'
        f"{_filters(counts_of(doc or {}), states)}{status}"
        f'<div class="note">database: {escape(doc["database"]) if doc else ""}</div>'
        f"{_best(doc)}{chart}{_pager(doc, states)}"
        "<table><thead><tr>"
        + "".join(f"<th>{escape(c)}</th>" for c in COLUMNS)
        + f'</tr></thead><tbody id="runs">{"".join(rows)}</tbody></table>'
        + (timeline_svg(doc) if doc else "")
    )
    return shell(title, body, script, nonce)
