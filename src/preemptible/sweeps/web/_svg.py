"""The web page's charts: small SVG drawn on the server, no library and no script.

A chart is a few ``<polyline>``/``<path>`` elements over two linear axes, with vertical
markers (a preemption, a resume) that carry their step in ``data-step``. Every text in it
(a metric's name, a run id) comes from the queue or a run, so it is escaped here; styling is
by presentation attributes (``stroke=``, ``fill=``), never ``style=``, which the page's
Content-Security-Policy would refuse. Points are thinned on the server (``envelope``): a chart
is a few tens of KB however long the run or large the sweep.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ._html import escape

WIDTH, HEIGHT = 640, 240
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 40, 34
MAX_POINTS = 800  # per series, after ``envelope``
_NS = "http://www.w3.org/2000/svg"
_P = TypeVar("_P", bound=tuple[float, ...])  # a point: (x, y, anything more carried along)


@dataclass(frozen=True)
class Series:
    name: str
    points: Sequence[tuple[float, float]]
    colour: str
    kind: str = "line"  # "line", "step" (a best-so-far line) or "dots"
    attempt: int | None = None  # a run's curve: the attempt that reported these points


@dataclass(frozen=True)
class Marker:
    x: float
    label: str  # shown on hover (its <title>)
    kind: str  # its class (marker-KIND) and its data-marker
    colour: str
    dashed: bool = True
    text: str = ""  # a short label beside the line (the right side; ``left``: the left)
    left: bool = False


@dataclass(frozen=True)
class Chart:
    title: str
    x_label: str
    y_label: str
    series: Sequence[Series]
    markers: Sequence[Marker] = field(default_factory=tuple)
    chart_id: str = ""


def envelope(points: Sequence[_P], limit: int = MAX_POINTS) -> list[_P]:
    """``points`` (by x) as at most about ``limit`` points that keep the curve's shape: the
    first, lowest, highest and last point of each of ``limit // 4`` ranges of x. A point may
    carry more than (x, y) (a run's attempt): it is kept or dropped whole."""
    if len(points) <= limit:
        return list(points)
    bins = max(1, limit // 4)
    lo, hi = points[0][0], points[-1][0]
    span = (hi - lo) or 1.0
    out: list[_P] = []
    group: list[_P] = []
    current = -1
    for point in points:
        b = min(bins - 1, int((point[0] - lo) / span * bins))
        if b != current and group:
            out.extend(_keep(group))
            group = []
        current = b
        group.append(point)
    out.extend(_keep(group))
    return out


def _keep(group: list[_P]) -> list[_P]:
    low = min(group, key=lambda p: p[1])
    high = max(group, key=lambda p: p[1])
    return sorted({group[0], low, high, group[-1]})


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round values between ``lo`` and ``hi``."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, count)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    ticks: list[float] = []
    value = first
    while value <= hi + step * 1e-9 and len(ticks) < 4 * count:
        ticks.append(0.0 if abs(value) < step * 1e-9 else value)
        value += step
    return ticks


def _range(values: Sequence[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi == lo:
        pad = abs(lo) * 0.05 or 1.0
        return lo - pad, hi + pad
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


def render(chart: Chart, *, width: int = WIDTH, height: int = HEIGHT) -> str:
    """The chart as one ``<svg>`` element (standalone too: it names its namespace)."""
    points = [p for s in chart.series for p in s.points if math.isfinite(p[0] + p[1])]
    ident = f' id="{escape(chart.chart_id)}"' if chart.chart_id else ""
    head = (
        f'<svg xmlns="{_NS}"{ident} class="chart" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="{escape(chart.title)}">'
        f"<title>{escape(chart.title)}</title>"
        f'<text x="{_LEFT}" y="16" font-size="13" font-weight="bold" fill="#222">'
        f"{escape(chart.title)}</text>"
    )
    if not points:
        return (
            head + f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" fill="#888" '
            'font-size="13">nothing reported yet</text></svg>'
        )
    xs = [p[0] for p in points] + [m.x for m in chart.markers if math.isfinite(m.x)]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = _range([p[1] for p in points])
    plot_w, plot_h = width - _LEFT - _RIGHT, height - _TOP - _BOTTOM

    def sx(x: float) -> float:
        return _LEFT + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return _TOP + (1 - (y - y0) / (y1 - y0)) * plot_h

    parts = [head, _axes((x0, x1, y0, y1), sx, sy, chart, width, height)]
    for s in chart.series:
        parts.append(_series(s, sx, sy))
    for row, m in enumerate(m for m in chart.markers if math.isfinite(m.x)):
        parts.append(_marker(m, sx(m.x), (width, height), row))
    parts.append(_legend(chart.series, width))
    parts.append("</svg>")
    return "".join(parts)


_Scale = Callable[[float], float]


def _axes(
    box: tuple[float, float, float, float],
    sx: _Scale,
    sy: _Scale,
    chart: Chart,
    width: int,
    height: int,
) -> str:
    x0, x1, y0, y1 = box
    bottom, left, right = height - _BOTTOM, _LEFT, width - _RIGHT
    out = [
        f'<g class="axes" stroke="#999" fill="none"><line x1="{left}" y1="{_TOP}" x2="{left}" '
        f'y2="{bottom}"/><line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}"/></g>'
        '<g font-size="11" fill="#555">'
    ]
    for t in nice_ticks(y0, y1):
        y = sy(t)
        out.append(
            f'<line x1="{left - 4}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#eee"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{escape(f"{t:.4g}")}</text>'
        )
    for t in nice_ticks(x0, x1):
        x = sx(t)
        label = f"{t:.0f}" if float(t).is_integer() else f"{t:.4g}"
        out.append(
            f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="#999"/>'
            f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{escape(label)}</text>'
        )
    out.append(
        f'<text x="{(left + right) / 2}" y="{height - 2}" text-anchor="middle">'
        f"{escape(chart.x_label)}</text>"
        f'<text x="12" y="{(_TOP + bottom) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 12 {(_TOP + bottom) / 2})">{escape(chart.y_label)}</text></g>'
    )
    return "".join(out)


def _series(s: Series, sx: _Scale, sy: _Scale) -> str:
    pts = [(sx(x), sy(y)) for x, y in s.points if math.isfinite(x + y)]
    if not pts:
        return ""
    name = escape(s.name)
    hooks = f'data-name="{name}"' + ("" if s.attempt is None else f' data-attempt="{s.attempt}"')
    if s.kind == "dots" or len(pts) == 1:  # one point is no line: a dot
        path = "".join(f"M{x:.1f} {y:.1f}h0" for x, y in pts)
        return (
            f'<path class="series dots" {hooks} d="{path}" stroke="{escape(s.colour)}" '
            'stroke-width="4" stroke-linecap="round" stroke-opacity="0.55" fill="none"/>'
        )
    if s.kind == "step":
        coords = [pts[0]]
        for x, y in pts[1:]:
            coords += [(x, coords[-1][1]), (x, y)]
        pts = coords
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
    return (
        f'<polyline class="series line" {hooks} points="{line}" '
        f'stroke="{escape(s.colour)}" stroke-width="1.8" fill="none"/>'
    )


def _marker(m: Marker, x: float, size: tuple[int, int], row: int) -> str:
    width, height = size
    dash = ' stroke-dasharray="4 3"' if m.dashed else ""
    step = f"{m.x:.0f}" if float(m.x).is_integer() else f"{m.x:g}"
    text = ""
    if m.text:  # beside the line, a row lower for each marker before it (they may meet)
        room = 5.5 * len(m.text) + 8  # about the text's width at font-size 10
        left = x - room >= _LEFT if m.left else x + room > width - _RIGHT  # kept inside
        anchor, dx = ("end", -4) if left else ("start", 4)
        text = (
            f'<text class="marker-text" x="{x + dx:.1f}" y="{_TOP + 18 + 12 * (row % 4)}" '
            f'text-anchor="{anchor}" font-size="10" fill="{escape(m.colour)}">'
            f"{escape(m.text)}</text>"
        )
    return (
        f'<g class="marker marker-{escape(m.kind)}" data-step="{escape(step)}" '
        f'data-marker="{escape(m.kind)}" data-x="{x:.1f}"><title>{escape(m.label)}</title>'
        f'<line x1="{x:.1f}" y1="{_TOP}" x2="{x:.1f}" y2="{height - _BOTTOM}" '
        f'stroke="{escape(m.colour)}" stroke-width="1.5"{dash}/>'
        f'<path d="M{x - 5:.1f} {_TOP}h10l-5 7z" fill="{escape(m.colour)}"/>{text}</g>'
    )


def _legend(series: Sequence[Series], width: int) -> str:
    """A line under the title: a swatch and the name of each series."""
    out = ['<g class="legend" font-size="11" fill="#333">']
    x = float(_LEFT)
    shown: set[tuple[str, str]] = set()
    for s in series:
        if (s.name, s.colour) in shown:  # a curve drawn in pieces (an attempt's) is named once
            continue
        shown.add((s.name, s.colour))
        text = s.name if len(s.name) <= 40 else s.name[:39] + "…"
        out.append(
            f'<rect x="{x:.0f}" y="22" width="10" height="10" fill="{escape(s.colour)}"/>'
            f'<text x="{x + 14:.0f}" y="31">{escape(text)}</text>'
        )
        x += 6.5 * len(text) + 30
    out.append("</g>")
    return "".join(out)
