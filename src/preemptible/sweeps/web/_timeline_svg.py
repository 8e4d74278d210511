"""The attempts timeline of the runs on a page of the table, as SVG (``/timeline.svg``): a row
per run, a bar per attempt from its start to its end (now, while it runs) coloured by how it
ended as in ``status --plot``, and a mark where an attempt was preempted or lost its lease.

Drawn from the sweep document (``_web_page.sweep_document``: at most a page of runs), escaped
like every chart (``_svg``): a few milliseconds, where matplotlib takes most of a second.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._states import Ending
from ..status._timeline import ENDING_COLOURS
from ._html import escape
from ._svg import _NS, nice_ticks

ROW = 16  # pixels per run
_LEFT, _RIGHT, _TOP, _BOTTOM = 130, 16, 40, 34
WIDTH = 900


def _unit(span: float) -> tuple[float, str]:
    if span >= 3 * 3600:
        return 3600.0, "h"
    if span >= 3 * 60:
        return 60.0, "min"
    return 1.0, "s"


def timeline_svg(doc: Mapping[str, Any]) -> str:
    """The timeline of ``doc``'s runs (each with its ``attempt_log``), oldest run on top."""
    runs = sorted(doc.get("runs") or (), key=lambda r: r["index"])
    now = float(doc["now"])
    starts = [a["started_at"] for r in runs for a in r.get("attempt_log") or ()]
    height = _TOP + _BOTTOM + ROW * max(1, len(runs))
    head = (
        f'<svg xmlns="{_NS}" id="timeline" class="chart" viewBox="0 0 {WIDTH} {height}" '
        f'width="{WIDTH}" height="{height}" role="img" aria-label="attempts timeline">'
        "<title>attempts of the runs in the table</title>"
        f'<text x="{_LEFT}" y="16" font-size="13" font-weight="bold" fill="#222">'
        "attempts of the runs in the table</text>"
    )
    if not starts:
        return (
            head + f'<text x="{WIDTH / 2}" y="{_TOP + 10}" text-anchor="middle" fill="#888" '
            'font-size="13">no attempt yet</text></svg>'
        )
    origin = min(starts)
    ends = [
        (a["ended_at"] if a["ended_at"] is not None else now)
        for r in runs
        for a in r.get("attempt_log") or ()
    ]
    span = max(max(ends) - origin, 1e-3)
    unit, name = _unit(span)
    plot_w = WIDTH - _LEFT - _RIGHT

    def sx(t: float) -> float:
        return float(_LEFT + (t - origin) / span * plot_w)

    parts = [head, _legend()]
    bottom = height - _BOTTOM
    parts.append('<g font-size="11" fill="#555">')
    for tick in nice_ticks(0, span / unit):
        x = sx(origin + tick * unit)
        parts.append(
            f'<line x1="{x:.1f}" y1="{_TOP}" x2="{x:.1f}" y2="{bottom}" stroke="#eee"/>'
            f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle">{tick:g}</text>'
        )
    parts.append(
        f'<text x="{_LEFT + plot_w / 2}" y="{height - 4}" text-anchor="middle">'
        f"time since the first attempt shown ({name})</text></g>"
    )
    for row, run in enumerate(runs):
        y = _TOP + row * ROW
        label = run["run_id"] if len(run["run_id"]) <= 18 else run["run_id"][:17] + "…"
        parts.append(
            f'<g class="run" data-run="{escape(run["run_id"])}"><text x="{_LEFT - 6}" '
            f'y="{y + ROW - 4}" text-anchor="end" font-size="11" fill="#333">{escape(label)}</text>'
        )
        for a in run.get("attempt_log") or ():
            end = a["ended_at"] if a["ended_at"] is not None else now
            x0, x1 = sx(a["started_at"]), sx(end)
            ending = a["ending"]
            colour = ENDING_COLOURS.get(ending, "#9467bd")
            what = f"attempt {a['number']}: {ending or 'still running'}"
            parts.append(
                f'<rect class="attempt ending-{escape(ending)}" data-attempt="{a["number"]}" '
                f'x="{x0:.1f}" y="{y + 2}" width="{max(x1 - x0, 1.5):.1f}" height="{ROW - 4}" '
                f'fill="{escape(colour)}" stroke="#333" stroke-width="0.5">'
                f"<title>{escape(what)}</title>"
                "</rect>"
            )
            if ending == Ending.PREEMPTED or a.get("lost"):
                parts.append(f'<path class="stop" d="M{x1:.1f} {y + 1}l4 -5h-8z" fill="#333"/>')
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


def _legend() -> str:
    out = ['<g class="legend" font-size="11" fill="#333">']
    x = float(_LEFT)
    for ending, colour in ENDING_COLOURS.items():
        text = ending or "still running"
        out.append(
            f'<rect x="{x:.0f}" y="22" width="10" height="10" fill="{escape(colour)}"/>'
            f'<text x="{x + 14:.0f}" y="31">{escape(text)}</text>'
        )
        x += 6.5 * len(text) + 30
    out.append("</g>")
    return "".join(out)
