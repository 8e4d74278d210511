"""``preemptible status SWEEP --serve``: the sweep as a live web page.

A small HTTP server of the standard library (one thread per request), bound to 127.0.0.1
unless ``--host`` says otherwise, with fixed routes and nothing else (any other path is a 404,
so no file is ever served from disk):

* ``/``: the page, with no external assets (the machine may have no network): inline CSS,
  the table drawn on the server, and a few lines of JavaScript that read ``/api/sweep`` every
  2 s and redraw it. Everything shown comes from the queue, which any agent, run or spec
  writes, so the server escapes it into the HTML and the script only ever sets text
  (``textContent``), never markup;
* ``/api/sweep``: the sweep as JSON (the table's document of ``_status.table_snapshot``: the
  sweep's header and counts, at most ``MAX_ROWS`` runs, and the cells the page shows);
* ``/plot.png``: the timeline of ``_status.timeline_figure`` (404 without matplotlib).

The database is read with one connection (``open_store(reader=True)``), one request at a time.
Its address is shown as ``Store.display``: never its password. A database that fails is a 503
with the reason; the page then keeps the last table under a line saying since when.

Served on a loopback address, a request must name the server by a loopback name in its
``Host`` header: a web page elsewhere cannot read the sweep through a DNS name of its own
that it points at 127.0.0.1 (DNS rebinding).

Ctrl+C, SIGTERM or SIGHUP stops the server: the handler only records that a stop came; the
main thread, which serves, sees it within ``_POLL`` seconds, closes the server and the
database, and the command exits 0.
"""

from __future__ import annotations

import html
import importlib.util
import io
import ipaddress
import json
import logging
import secrets
import signal
import sys
import threading
import time
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import IO, Any
from urllib.parse import urlsplit

from .._env import env_float
from .._errors import ConfigError, PreemptibleError
from .._text import format_age, printable
from ..stop._signals import install_handlers, restore_handlers, signal_name
from ._status import (
    MAX_ROWS,
    STATES,
    UNREADABLE,
    _encode,
    _header_line,
    _hidden_line,
    format_params,
    snapshot,
    table_snapshot,
    timeline_figure,
)
from ._store import DEFAULT_RETRY_TIMEOUT, Store, open_store

logger = logging.getLogger("preemptible")

DEFAULT_PORT = 8765
REFRESH = 2.0  # seconds between the page's reads of /api/sweep
_POLL = 0.25  # how often the serving thread looks whether a stop came
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
COLUMNS = ("run", "state", "attempt", "params", "metric", "ckpt step", "age", "agent@host")
STATE_COLOURS = {
    "FINISHED": "#2ca02c",
    "RUNNING": "#1f77b4",
    "PENDING": "#888888",
    "PREEMPTED": "#c98f00",
    "CRASHED": "#ff7f0e",
    "FAILED": "#d62728",
    "KILLED": "#8c1c13",
    "CANCELLED": "#7f7f7f",
}


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


def sweep_document(store: Store, sweep_id: str, *, now: float | None = None) -> dict[str, Any]:
    """What ``/api/sweep`` answers: the sweep's header (and the line the table shows above its
    rows), the counts by state, at most ``MAX_ROWS`` runs with their cells, and ``hidden``."""
    at = time.time() if now is None else now
    doc = table_snapshot(store, sweep_id, now=at, limit=MAX_ROWS)
    sweep = doc["sweep"]
    runs = []
    for run in sorted(doc["runs"], key=lambda r: r["index"]):
        age = _age(run, at)
        runs.append(
            {
                "run_id": run["run_id"],
                "index": run["index"],
                "state": run["state"],
                "attempt": run["attempts"],
                "params": run["params"],
                "metric": run["metric"],
                "checkpoint_step": run["checkpoint_step"],
                "age": age,
                "agent": run["agent"],
                "host": run["host"],
                "cells": _cells(run, age),
            }
        )
    hidden = doc.get("hidden")
    return {
        "sweep": {k: v for k, v in sweep.items() if k != "unreadable"},
        "header": _header_line(sweep, at).plain,
        "database": store.display,
        "now": at,
        "counts": {s: sweep["counts"].get(s, 0) for s in STATES},
        "runs": runs,
        "hidden": None if not hidden else _hidden_line(hidden, len(runs)).plain,
    }


# -- the page ---------------------------------------------------------------------------------
_CSS = """
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.2em;margin:0 0 .3em}
#header{margin:.3em 0;white-space:pre-wrap}
#status{color:#555;margin:.3em 0}
#status.down{color:#b00;font-weight:bold}
.counts span{display:inline-block;margin:0 .6em .3em 0;padding:.1em .5em;border-radius:.6em;
 color:#fff}
table{border-collapse:collapse;margin-top:.6em}
th,td{border-bottom:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f4f4f4}
td.params{font-family:ui-monospace,monospace;word-break:break-all;max-width:40em}
#plot{max-width:100%;margin-top:1em}
"""
_CSS += "".join(f".s-{s}{{color:{c};font-weight:bold}}\n" for s, c in STATE_COLOURS.items())
_CSS += "".join(f".counts .c-{s}{{background:{c}}}\n" for s, c in STATE_COLOURS.items())

# Only text is ever set (textContent): a run's params are the user's, never markup.
_JS = """
const COLS = %(columns)s;
let downSince = null;
function text(el, value) { el.textContent = value; }
function draw(d) {
  text(document.getElementById('header'), d.header);
  const counts = document.getElementById('counts');
  counts.replaceChildren();
  for (const [state, n] of Object.entries(d.counts)) {
    if (!n) continue;
    const chip = document.createElement('span');
    chip.className = 'c-' + state;
    text(chip, n + ' ' + state);
    counts.appendChild(chip);
  }
  const body = document.getElementById('runs');
  const rows = [];
  for (const run of d.runs) {
    const tr = document.createElement('tr');
    tr.dataset.run = run.run_id;
    tr.dataset.state = run.state;
    run.cells.forEach((cell, i) => {
      const td = document.createElement('td');
      td.className = COLS[i] === 'state' ? 'state s-' + run.state : COLS[i].replace(/\\W/g, '');
      text(td, cell);
      tr.appendChild(td);
    });
    rows.push(tr);
  }
  body.replaceChildren(...rows);
  text(document.getElementById('hidden'), d.hidden || (d.runs.length ? '' : 'no runs yet'));
}
async function refresh() {
  const status = document.getElementById('status');
  try {
    const r = await fetch('/api/sweep', {cache: 'no-store'});
    const d = await r.json();
    if (!r.ok) throw new Error(d.error || ('HTTP ' + r.status));
    draw(d);
    downSince = null;
    status.className = '';
    text(status, 'updated ' + new Date().toLocaleTimeString());
  } catch (e) {
    if (downSince === null) downSince = new Date();
    status.className = 'down';
    text(status, 'unreachable since ' + downSince.toLocaleTimeString() +
      ', showing the last table (' + e.message + ')');
  } finally {
    setTimeout(refresh, %(refresh)d);
  }
}
const plot = document.getElementById('plot');
if (plot) setInterval(() => { plot.src = '/plot.png?t=' + Date.now(); }, %(plot_every)d);
setTimeout(refresh, %(refresh)d);
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _css_name(column: str) -> str:
    """The class of a column's cells (as the script names them: no spaces or ``@``)."""
    return "".join(c for c in column if c.isalnum() or c == "_")


def render_page(doc: Mapping[str, Any] | None, error: str | None, *, nonce: str, plot: bool) -> str:
    """The page: ``doc`` (``sweep_document``) drawn on the server, or ``error`` in its place."""
    rows = []
    for run in (doc or {}).get("runs", ()):
        classes = [f"state s-{run['state']}" if c == "state" else _css_name(c) for c in COLUMNS]
        cells = "".join(
            f'<td class="{_e(k)}">{_e(cell)}</td>'
            for k, cell in zip(classes, run["cells"], strict=True)
        )
        state = _e(run["state"])
        rows.append(f'<tr data-run="{_e(run["run_id"])}" data-state="{state}">{cells}</tr>')
    counts = "".join(
        f'<span class="c-{_e(s)}">{n} {_e(s)}</span>'
        for s, n in ((doc or {}).get("counts") or {}).items()
        if n
    )
    title = f"sweep {doc['sweep']['id']}" if doc else "sweep"
    hidden = (doc.get("hidden") or ("" if doc["runs"] else "no runs yet")) if doc else ""
    status = f'<div id="status" class="down">{_e(error)}</div>' if error else '<div id="status">'
    status += "" if error else "</div>"
    script = _JS % {
        "columns": json.dumps(list(COLUMNS)),
        "refresh": int(REFRESH * 1000),
        "plot_every": int(5 * REFRESH * 1000),
    }
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width,initial-scale=1">'
        f"<title>{_e(printable(title))} · preemptible</title>"
        f'<style nonce="{nonce}">{_CSS}</style></head><body>'
        f"<h1>{_e(printable(title))}</h1>"
        f'<div id="header">{_e(doc["header"] if doc else "")}</div>'
        f'<div class="counts" id="counts">{counts}</div>{status}'
        f"<div>database: {_e(doc['database']) if doc else ''}</div>"
        "<table><thead><tr>"
        + "".join(f"<th>{_e(c)}</th>" for c in COLUMNS)
        + f'</tr></thead><tbody id="runs">{"".join(rows)}</tbody></table>'
        f'<div id="hidden">{_e(hidden)}</div>'
        + ('<img id="plot" src="/plot.png" alt="timeline of the attempts">' if plot else "")
        + f'<script nonce="{nonce}">{script}</script></body></html>\n'
    )


# -- the server -------------------------------------------------------------------------------
class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck browser never holds the command open at exit

    def __init__(self, address: tuple[str, int], store: Store, sweep_id: str) -> None:
        self.store = store
        self.sweep_id = sweep_id
        self.lock = threading.Lock()  # one Store is one connection: one request at a time
        self.plot = importlib.util.find_spec("matplotlib") is not None
        super().__init__(address, _Handler)
        self.allowed_hosts: set[str] | None = None
        if _is_loopback(address[0]):
            port = self.server_address[1]
            names = {"localhost", "127.0.0.1", "[::1]", address[0], f"[{address[0]}]"}
            self.allowed_hosts = {f"{n}:{port}" for n in names} | names

    def read(self) -> dict[str, Any]:
        with self.lock:
            return sweep_document(self.store, self.sweep_id)

    def png(self) -> bytes:
        with self.lock:
            doc = snapshot(self.store, self.sweep_id)
        figure = timeline_figure(doc)
        out = io.BytesIO()
        figure.savefig(out, format="png")
        return out.getvalue()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "preemptible"
    sys_version = ""

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        host = self.headers.get("Host", "").lower()
        if self.server.allowed_hosts is not None and host not in self.server.allowed_hosts:
            self._send(HTTPStatus.FORBIDDEN, "text/plain", b"unknown Host header\n")
            return
        route = urlsplit(self.path).path
        try:
            if route == "/":
                self._page()
            elif route == "/api/sweep":
                self._api()
            elif route == "/plot.png" and self.server.plot:
                self._send(HTTPStatus.OK, "image/png", self.server.png())
            else:
                self._send(HTTPStatus.NOT_FOUND, "text/plain", b"not found\n")
        except PreemptibleError as exc:
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, "text/plain", f"{exc}\n".encode())
        except (BrokenPipeError, ConnectionResetError):
            pass  # the browser went away

    def _page(self) -> None:
        nonce = secrets.token_urlsafe(16)
        doc, error = None, None
        try:
            doc = self.server.read()
        except PreemptibleError as exc:
            error = f"database unreachable: {exc}"
        page = render_page(doc, error, nonce=nonce, plot=self.server.plot)
        policy = (
            f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
            "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'"
        )
        status = HTTPStatus.OK if error is None else HTTPStatus.SERVICE_UNAVAILABLE
        self._send(status, "text/html; charset=utf-8", page.encode(), policy=policy)

    def _api(self) -> None:
        try:
            body, status = _encode(self.server.read()), HTTPStatus.OK
        except PreemptibleError as exc:
            body, status = _encode({"error": str(exc)}), HTTPStatus.SERVICE_UNAVAILABLE
        self._send(status, "application/json", body.encode())

    def _send(self, status: HTTPStatus, kind: str, body: bytes, *, policy: str = "") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", policy or "default-src 'none'")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("preemptible: web: " + format, *args)


def page_address(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    if host in ("0.0.0.0", "::"):  # every address of this host: name one that works here
        shown = "127.0.0.1" if host == "0.0.0.0" else "[::1]"
    return f"http://{shown}:{port}/"


def serve_status(
    db: str | None,
    sweep_id: str,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    out: IO[str] | None = None,
) -> None:
    """Serve the sweep's page until Ctrl+C, SIGTERM or SIGHUP (then return: exit 0). The
    first line written to ``out`` is ``serving sweep ID at http://HOST:PORT/`` (port 0: the
    free port the system picked)."""
    out = sys.stdout if out is None else out
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: give a port between 1 and 65535, or 0 for a free one")
    configured = env_float("PREEMPTIBLE_DB_RETRY_TIMEOUT", DEFAULT_RETRY_TIMEOUT)
    retry = min(configured if configured is not None else DEFAULT_RETRY_TIMEOUT, 2.0)
    store = open_store(db, reader=True, retry_timeout=retry)
    server: _Server | None = None
    try:
        sweep_document(store, sweep_id)  # an unknown sweep is a ConfigError now, not a 503
        try:
            server = _Server((host, port), store, sweep_id)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve on {host}:{port}: {exc.strerror or exc}; choose another with "
                "--port N (0: any free port) or --host"
            ) from None
        stops: list[int] = []

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stops.append(signum)  # only noted: the serving loop below stops

        previous, _ = install_handlers(_SIGNALS, on_signal)
        try:
            server.timeout = _POLL
            address = page_address(host, server.server_address[1])
            print(f"serving sweep {printable(sweep_id)} at {address} (Ctrl+C stops)", file=out)
            out.flush()
            while not stops:
                server.handle_request()
        finally:
            restore_handlers(previous, ours=on_signal)
            server.server_close()
        print(f"stopped ({signal_name(stops[0])})", file=out)
        out.flush()
    finally:
        # a request still reading (in its thread) finishes first; a database that hangs
        # holds the exit for at most a few seconds
        held = server is None or server.lock.acquire(timeout=5.0)
        if held:
            store.close()
