"""What the web pages share: escaping, the state colours, the style sheet, the page's shell,
and the reading of a page's query (``?state=RUNNING&state=FAILED&page=2``).

Everything a page shows comes from the queue or from files a run wrote, which any agent, run
or spec can fill: every text goes through ``escape`` (HTML-escaped, control characters shown as
escapes), and the pages' scripts only set text (``textContent``) or put in place markup that
this server drew (``DOMParser``: nothing in it runs; the Content-Security-Policy allows only
the page's own nonce-carrying script, no inline handler).
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from urllib.parse import parse_qs, urlencode

from ..._errors import ConfigError
from ..._states import QueueState
from ..._text import printable
from ..status._snapshot import STATES

MAX_PAGE = 10**9

STATE_COLOURS = {
    QueueState.FINISHED: "#2ca02c",
    QueueState.RUNNING: "#1f77b4",
    QueueState.PENDING: "#888888",
    QueueState.PREEMPTED: "#c98f00",
    QueueState.CRASHED: "#ff7f0e",
    QueueState.FAILED: "#d62728",
    QueueState.KILLED: "#8c1c13",
    QueueState.CANCELLED: "#7f7f7f",
    QueueState.STOPPED: "#e377c2",
}

CSS = """
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.2em;margin:0 0 .3em}
h2{font-size:1.05em;margin:1.2em 0 .4em}
a{color:#1558b0}
#header{margin:.3em 0;white-space:pre-wrap}
#status{color:#555;margin:.3em 0}
#status.down{color:#b00;font-weight:bold}
#filters{margin:.4em 0}
#filters label{display:inline-block;margin:0 .5em .3em 0;padding:.1em .5em;border-radius:.6em;
 color:#fff;cursor:pointer;user-select:none}
#filters input{margin:0 .3em 0 0;vertical-align:-1px}
table{border-collapse:collapse;margin-top:.6em}
th,td{border-bottom:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f4f4f4}
td.params,dd.params,pre{font-family:ui-monospace,monospace;word-break:break-all}
td.params{max-width:40em}
#pager{margin:.5em 0}
#pager a{margin:0 .6em}
#pager a[hidden]{display:none}
#best{margin:.6em 0}
svg.chart{display:block;margin:.4em 0;max-width:100%;height:auto;border:1px solid #eee}
#plot{max-width:100%;margin-top:1em}
#curves{display:flex;flex-wrap:wrap;gap:0 .8em}
figure.curve{margin:0;max-width:100%}
dl.run{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}
dl.run dt{font-weight:bold}
dl.run dd{margin:0}
pre{background:#f7f7f7;padding:.5em;max-height:30em;overflow:auto;white-space:pre-wrap}
tr.ending-PREEMPTED td{background:#fff6dd}
.note{color:#666}
"""
CSS += "".join(f".s-{s}{{color:{c};font-weight:bold}}\n" for s, c in STATE_COLOURS.items())
CSS += "".join(f"#filters .c-{s}{{background:{c}}}\n" for s, c in STATE_COLOURS.items())


def escape(value: object) -> str:
    """``value`` as HTML text or attribute: escaped, control characters as escapes."""
    return html.escape(printable(str(value)), quote=True)


def shell(title: str, body: str, script: str, nonce: str) -> str:
    """A whole page: its style sheet and its one script carry ``nonce``."""
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width,initial-scale=1">'
        f"<title>{escape(title)} · preemptible</title>"
        f'<style nonce="{nonce}">{CSS}</style></head><body>{body}'
        f'<script nonce="{nonce}">{script}</script></body></html>\n'
    )


def policy(nonce: str) -> str:
    """The pages' Content-Security-Policy: nothing from elsewhere, no inline handler, and
    the filters' form may only go to this server."""
    return (
        f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
        "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    )


def parse_query(query: str) -> tuple[frozenset[str], int]:
    """The states (``state=A&state=B`` or ``state=A,B``; none: every run) and the page
    number (from 1) a query asks for; ConfigError names what is wrong (the server: a 400)."""
    try:
        fields = parse_qs(query, keep_blank_values=False, strict_parsing=False, max_num_fields=64)
    except ValueError as exc:
        raise ConfigError(f"the query cannot be read: {exc}") from None
    states: set[str] = set()
    for value in fields.get("state", ()):
        for state in value.split(","):
            name = state.strip().upper()
            if not name:
                continue
            if name not in STATES:
                raise ConfigError(
                    f"state={printable(state)[:40]!r} is not a run state; use {', '.join(STATES)}"
                )
            states.add(name)
    page = 1
    pages = fields.get("page", ())
    if pages:
        text = pages[-1]
        if not (text.isascii() and text.isdecimal()) or not 1 <= int(text) <= MAX_PAGE:
            raise ConfigError(f"page={printable(text)[:40]!r} is not valid; use a number from 1")
        page = int(text)
    unknown = sorted(set(fields) - {"state", "page", "t"})
    if unknown:
        raise ConfigError(
            f"unknown query field {printable(unknown[0])[:40]!r}; the page takes state= and page="
        )
    return frozenset(states), page


def query_of(states: frozenset[str], page: int = 1) -> str:
    """The query string (with its ``?``; empty for every run, page 1) of a filtered page."""
    fields: list[tuple[str, str]] = [("state", s) for s in STATES if s in states]
    if page > 1:
        fields.append(("page", str(page)))
    return "?" + urlencode(fields) if fields else ""


def counts_of(doc: Mapping[str, object]) -> Mapping[str, int]:
    counts = doc.get("counts")
    return counts if isinstance(counts, Mapping) else {}
