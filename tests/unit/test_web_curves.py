"""A run's metric curves on its page: a chart per metric from the run's history, a line per
attempt, each preemption and resume marked where it happened, every name escaped, long
histories thinned; drawn from plain data (``Store.run_history``'s shape) and the marks that
``interruptions`` finds in the run's attempts."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from preemptible.sweeps.store._queue import Store, open_store
from preemptible.sweeps.web._run_page import (
    CURVE_POINTS,
    CURVE_SIZE,
    MAX_CURVES,
    curve_charts,
    curves,
    interruptions,
    render_live,
    render_run_page,
    run_document,
    thin,
)
from tests.support.sweep_queue import attempt_row

pytestmark = pytest.mark.timeout(60)

NS = {"s": "http://www.w3.org/2000/svg"}
HOSTILE = ("<script>alert('x')</script>", "\"&'", "loss</text><script>alert(1)</script>")
_LEFT, _RIGHT = 64, 16  # the plot's margins in _web_svg


# attempt 1 reported 0..30 and was preempted with a checkpoint at 30; attempt 2 resumed from
# 30 (its points before were trimmed), reported 31..55, was preempted at 55; attempt 3 went on
ATTEMPTS = [
    attempt_row(1, "PREEMPTED", 30),
    attempt_row(2, "PREEMPTED", 55),
    attempt_row(3, None, 80),
]
HISTORY = {
    "loss": [(s, 1.0 / (s + 1), 1 if s <= 30 else 2 if s <= 55 else 3) for s in range(81)],
    "acc": [(s, s / 80, 1 if s <= 30 else 2 if s <= 55 else 3) for s in range(0, 81, 10)],
}


def _doc(history: Any, metric: str | None = "loss") -> dict[str, Any]:
    return {"curves": curves(history, metric), "marks": interruptions(ATTEMPTS)}


def _figures(doc: dict[str, Any]) -> list[ET.Element]:
    return [ET.fromstring(f) for f in curve_charts(doc)]  # well-formed: DOMParser takes it


def _x(step: float, lo: float, hi: float) -> float:
    return _LEFT + (step - lo) / (hi - lo) * (CURVE_SIZE[0] - _LEFT - _RIGHT)


def test_a_chart_per_metric_a_line_per_attempt_and_the_stops_where_they_were() -> None:
    figures = _figures(_doc(HISTORY))
    assert [f.get("data-metric") for f in figures] == ["loss", "acc"]  # the sweep's first
    svg = figures[0].find("s:svg", NS)
    assert svg is not None and svg.get("width") == str(CURVE_SIZE[0])
    lines = svg.findall(".//s:polyline", NS)
    assert [line.get("data-attempt") for line in lines] == ["1", "2", "3"]
    assert len({line.get("stroke") for line in lines}) == 3  # coloured by attempt
    assert [len(line.get("points", "").split()) for line in lines] == [31, 25, 25]

    marks = svg.findall(".//s:g[@data-marker]", NS)
    assert [(m.get("data-marker"), m.get("data-step")) for m in marks] == [
        ("preempted", "30"),
        ("resumed", "30"),
        ("preempted", "55"),
        ("resumed", "55"),
    ]
    for m in marks:  # at the step's x: where attempt 1's line ends for step 30
        assert float(m.get("data-x", "nan")) == pytest.approx(
            _x(float(m.get("data-step", "nan")), 0, 80), abs=0.06
        )
        line = m.find("s:line", NS)
        assert line is not None and line.get("x1") == m.get("data-x")
    last = lines[0].get("points", "").split()[-1]
    assert float(last.split(",")[0]) == pytest.approx(_x(30, 0, 80), abs=0.06)
    labels = ["".join(t.itertext()) for t in svg.findall(".//s:text[@class='marker-text']", NS)]
    assert labels == [
        "preempted at 30",
        "attempt 2 from 30",
        "preempted at 55",
        "attempt 3 from 55",
    ]
    anchors = [t.get("text-anchor") for t in svg.findall(".//s:text[@class='marker-text']", NS)]
    assert anchors == ["end", "start", "end", "start"]  # a stop on the left, a resume right
    titles = [m.findtext("s:title", namespaces=NS) for m in marks]
    assert titles[0] == "attempt 1 ended PREEMPTED at step 30"
    assert titles[1] == "attempt 2 resumed from step 30"
    legend = "".join(svg.find(".//s:g[@class='legend']", NS).itertext())  # type: ignore[union-attr]
    assert legend == "attempt 1attempt 2attempt 3"

    # the sparse metric: the markers are on its chart too, at the same steps
    acc = figures[1].find("s:svg", NS)
    assert acc is not None
    assert [m.get("data-step") for m in acc.findall(".//s:g[@data-marker]", NS)] == [
        "30",
        "30",
        "55",
        "55",
    ]


def test_hostile_metric_names_are_text_everywhere() -> None:
    history = {name: [(0, 1.0, 1), (5, 0.5, 1)] for name in HOSTILE}
    doc = _doc(history, metric=HOSTILE[0])
    html = "".join(curve_charts(doc))
    assert "<script" not in html and "\"&'" not in html and "style=" not in html
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    assert "&quot;&amp;&#x27;" in html
    figures = _figures(doc)
    assert [f.get("data-metric") for f in figures] == [
        HOSTILE[0],
        *sorted(HOSTILE[1:]),
    ]  # the parsed attribute is the name itself: escaped once, not twice
    for f, name in zip(figures, [HOSTILE[0], *sorted(HOSTILE[1:])], strict=True):
        svg = f.find("s:svg", NS)
        assert svg is not None and svg.get("aria-label", "").startswith(name)
        assert svg.findall(".//s:script", NS) == []
    live = render_live({**_page_doc(), **doc})
    assert "<script" not in live and ET.fromstring(live) is not None


def test_long_histories_are_thinned_and_keep_where_each_attempt_begins() -> None:
    points = [
        (s, math.sin(s / 500) + (5.0 if s == 7_777 else 0.0), 1 if s < 60_000 else 2)
        for s in range(100_000)
    ]
    kept = thin(points)
    assert len(kept) <= CURVE_POINTS + 8
    assert kept[0] == points[0] and kept[-1] == points[-1]
    assert points[59_999] in kept and points[60_000] in kept  # the two sides of the resume
    assert max(kept, key=lambda p: p[1]) == points[7_777]  # a spike survives
    assert [p[0] for p in kept] == sorted(p[0] for p in kept)
    assert thin(points[:50]) == points[:50]

    doc = _doc({"loss": points, "lr": [(0, math.nan, 1), (1, math.inf, 1), (2, 0.1, 1)]})
    assert doc["curves"]["drawn"]["loss"]["count"] == 100_000
    assert doc["curves"]["drawn"]["lr"] == {"count": 1, "points": [(2, 0.1, 1)]}
    svg = _figures(doc)[0].find("s:svg", NS)
    assert svg is not None and f"100000 reports, {len(kept)} points drawn" in (
        svg.findtext("s:title", namespaces=NS) or ""
    )
    lines = svg.findall(".//s:polyline", NS)
    assert [line.get("data-attempt") for line in lines] == ["1", "2"]
    one = _figures(doc)[1].find(".//s:path[@class='series dots']", NS)
    assert one is not None  # a single point is a dot, not an empty line


def test_at_most_max_curves_charts_and_the_page_says_so() -> None:
    history = {f"m{i:02d}": [(0, float(i), 1)] for i in range(MAX_CURVES + 3)}
    history["zz_loss"] = [(0, 1.0, 1)]
    doc = _doc(history, metric="zz_loss")
    drawn = list(doc["curves"]["drawn"])
    assert len(drawn) == MAX_CURVES and drawn[0] == "zz_loss" and drawn[1:3] == ["m00", "m01"]
    assert doc["curves"]["metrics"] == MAX_CURVES + 4
    live = render_live({**_page_doc(), **doc})
    assert f"{MAX_CURVES} of the {MAX_CURVES + 4} metrics drawn" in live
    assert live.count('<figure class="curve"') == MAX_CURVES
    few = render_live({**_page_doc(), **_doc(HISTORY)})
    assert 'id="curves-more"' not in few
    none = render_live({**_page_doc(), **_doc({})})
    assert "no metrics reported yet" in none


def _page_doc() -> dict[str, Any]:
    """The rest of a run document render_live reads."""
    return {
        "state": "RUNNING",
        "attempts": 3,
        "preemptions": 2,
        "failures": 0,
        "checkpoint_step": 55,
        "params": {"lr": 0.1},
        "summary": None,
        "agent": "a",
        "host": "h",
        "heartbeat_age": None,
        "created_at": 0.0,
        "attempt_log": [],
        "files": {"run_dir": "/x", "journal": [], "records": []},
    }


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(f"sqlite:///{tmp_path / 'sweeps.db'}", retry_timeout=10)
    yield s
    s.close()


def test_a_run_document_draws_the_stored_history(store: Store, tmp_path: Path) -> None:
    """On a real queue: reported, preempted at its checkpoint, trimmed and resumed as the
    agent does it; the document has the points drawn and the page the charts."""
    name = HOSTILE[0]
    spec = {
        "method": "random",
        "metric": {"name": name, "goal": "minimize"},
        "parameters": {"lr": {"min": 0.001, "max": 0.1}},
    }
    sweep = store.create_sweep(spec, name="s", run_cap=None, max_failures=0, max_preemptions=3)
    store.add_runs(sweep, [{"lr": 0.01}])
    c = store.claim(sweep, agent="a", host="h", lease=600, propose=None)
    assert c is not None
    store.add_history(
        c.run_id, [(st, name, 1 / (st + 1)) for st in range(41)], attempt=1, epoch=c.epoch
    )
    end = {"exit_code": 143, "duration": 1.0, "checkpoint_step": 30, "summary": None}
    assert store.finish(c.run_id, agent="a", attempt=1, ending="PREEMPTED", **end) == "PENDING"
    c2 = store.claim(sweep, agent="b", host="h", lease=600, propose=None)
    assert c2 is not None and c2.attempt == 2
    store.trim_history(c2.run_id, 30, epoch=c2.epoch)
    store.add_history(
        c2.run_id, [(st, name, 0.01) for st in range(31, 50)], attempt=2, epoch=c2.epoch
    )

    doc = run_document(store, sweep_id=sweep, run_id=c.run_id, home=tmp_path, metric=name)
    assert doc is not None and doc["curves"]["metrics"] == 1
    points = doc["curves"]["drawn"][name]["points"]
    assert [p[0] for p in points] == list(range(50))
    assert [p[2] for p in points] == [1] * 31 + [2] * 19
    page = render_run_page(doc, nonce="n0nce")
    assert name not in page and page.count("<script") == 1
    assert 'data-marker="preempted"' in page and 'data-marker="resumed"' in page
    assert 'data-attempt="1"' in page and 'data-attempt="2"' in page


def test_a_charts_labels_show_control_characters_as_escapes() -> None:
    """The charts escape through the page's one escape: an ESC in a metric's name is shown as
    ``\\x1b`` (and the SVG stays XML), as everywhere else on the page."""
    from preemptible.sweeps.web._svg import Chart, Series, render

    line = Series(name="loss\x07", points=[(0.0, 1.0), (1.0, 0.5)], colour="#000")
    svg = render(Chart(title="loss\x1b[31m", x_label="step", y_label="loss", series=[line]))
    assert "\x1b" not in svg and "\x07" not in svg
    assert "\\x1b[31m" in svg
    assert ET.fromstring(svg) is not None
