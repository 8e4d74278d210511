"""The web page's pieces without a server: the sweep model kept between requests (incremental
reads, counts, best-so-far, filters and pages), the query, the charts, and a run's document
with its files, all on a real SQLite queue whose clock the test sets."""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from preemptible import ConfigError
from preemptible.sweeps.store._queue import Store
from preemptible.sweeps.store._rows import Claim
from preemptible.sweeps.web import _model
from preemptible.sweeps.web._html import parse_query, query_of
from preemptible.sweeps.web._model import PAGE_ROWS, SweepModel
from preemptible.sweeps.web._page import best_chart, render_page, sweep_document
from preemptible.sweeps.web._run_page import interruptions, render_run_page, run_document
from preemptible.sweeps.web._svg import Chart, Marker, Series, envelope, nice_ticks, render
from preemptible.sweeps.web._timeline_svg import timeline_svg
from tests.support.sweep_queue import SPEC, Clock, attempt_row

pytestmark = pytest.mark.timeout(60)

EVIL = "<script>alert('x')</script>"


def _claim(sweep_store: Store, sweep: str, agent: str = "a") -> Claim:
    c = sweep_store.claim(sweep, agent=agent, host="h", lease=600, propose=None)
    assert c is not None
    return c


def _end(sweep_store: Store, c: Claim, ending: str, step: int | None, loss: float | None) -> str:
    return sweep_store.finish(
        c.run_id,
        agent="a",
        attempt=c.attempt,
        ending=ending,
        exit_code=0 if ending == "FINISHED" else 143,
        duration=1.0,
        checkpoint_step=step,
        summary=None if loss is None else {"loss": loss},
    )


def _sweep(sweep_store: Store, runs: int, spec: dict[str, Any] = SPEC) -> tuple[str, list[str]]:
    sweep = sweep_store.create_sweep(
        spec, name=EVIL, run_cap=None, max_failures=0, max_preemptions=3
    )
    ids = sweep_store.add_runs(sweep, [{"lr": 0.001 * (i + 1)} for i in range(runs)])
    return sweep, ids


# -- the model --------------------------------------------------------------------------------
def test_the_model_reads_the_sweep_once_then_only_what_changed(
    sweep_store: Store, sweep_clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    sweep, ids = _sweep(sweep_store, 4)
    model = SweepModel(sweep)
    model.refresh(sweep_store)
    assert model.aggregate().counts["PENDING"] == 4 and model.aggregate().best is None
    reads: list[float] = []
    real = sweep_store.read

    def counting(fn: Any) -> Any:
        result = real(fn)
        if isinstance(result, tuple):
            reads.append(len(result[1]))  # the rows web_changed returned
        return result

    monkeypatch.setattr(sweep_store, "read", counting)
    model.refresh(sweep_store)  # the runs changed within MARGIN of the newest change: read again
    assert reads == [4] and model.version == 4

    sweep_clock.now = 2000.0
    c = _claim(sweep_store, sweep)
    sweep_clock.now = 2010.0
    model.refresh(sweep_store)
    assert reads[-1] == 4 and model.version == 5
    assert model.aggregate().counts["RUNNING"] == 1
    model.refresh(sweep_store)  # the others changed long before it: only the claimed run is read
    assert reads[-1] == 1 and model.version == 5

    # a heartbeat moves updated_at only: read again, but nothing to draw again
    sweep_store.heartbeat(c.run_id, agent="a", lease=600, attempt=1, epoch=c.epoch)
    version = model.version
    model.refresh(sweep_store)
    assert model.version == version

    sweep_clock.now = 2020.0
    _end(sweep_store, c, "FINISHED", 50, 0.5)
    model.refresh(sweep_store)
    agg = model.aggregate()
    assert agg.counts["FINISHED"] == 1 and agg.best == {
        "run_id": ids[0],
        "metric": 0.5,
        "index": 0,
    }

    # a write stamped earlier than the newest change seen (its transaction read the clock
    # first, committed last) is still found: within MARGIN of the newest
    c2 = _claim(sweep_store, sweep)
    sweep_clock.now = 2020.0 - _model.MARGIN / 2
    _end(sweep_store, c2, "FINISHED", 10, 0.25)
    model.refresh(sweep_store)
    assert model.aggregate().best == {"run_id": ids[1], "metric": 0.25, "index": 1}


def test_best_so_far_follows_the_goal_and_stays_small(
    sweep_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    losses = [0.9, 0.5, 0.7, None, 0.2, 0.3, 0.2]
    for goal, best, steps in (
        ("minimize", 4, [(0, 0.9), (1, 0.5), (4, 0.2), (6, 0.2)]),
        ("maximize", 0, [(0, 0.9), (6, 0.9)]),
    ):
        spec = {**SPEC, "metric": {"name": "loss", "goal": goal}}
        sweep, ids = _sweep(sweep_store, len(losses), spec)
        for loss in losses:
            c = _claim(sweep_store, sweep)
            _end(sweep_store, c, "FINISHED" if loss is not None else "FAILED", None, loss)
        model = SweepModel(sweep)
        model.refresh(sweep_store)
        agg = model.aggregate()
        assert agg.best is not None and agg.best["run_id"] == ids[best], goal
        assert agg.steps == steps, goal  # ties keep the first; the line runs to the last run
        assert agg.finished == 6 and not agg.binned
        assert agg.counts["FINISHED"] == 6 and agg.counts["FAILED"] == 1

    # many runs: the dots are each range's lowest and highest, the line one point per range
    monkeypatch.setattr(_model, "MAX_DOTS", 4)
    monkeypatch.setattr(_model, "BINS", 3)
    monkeypatch.setattr(_model, "MAX_STEPS", 2)
    agg = _model._aggregate(model.order, model.rows, model.head["metric"])
    assert agg.binned and len(agg.dots) <= 2 * 3
    assert min(v for _, v in agg.dots) == 0.2 and max(v for _, v in agg.dots) == 0.9
    assert len(agg.steps) <= 3 + 1 and agg.steps[0] == (0, 0.9)


def test_the_table_is_filtered_by_state_and_paged(sweep_store: Store, sweep_clock: Clock) -> None:
    sweep, ids = _sweep(sweep_store, PAGE_ROWS + 30)
    for i in range(PAGE_ROWS + 10):
        c = _claim(sweep_store, sweep)
        if i % 2 == 0:
            _end(sweep_store, c, "FINISHED", 5, float(i))
    model = SweepModel(sweep)
    doc = sweep_document(model, sweep_store)
    assert doc["page"] == {
        "number": 1,
        "pages": 2,
        "size": PAGE_ROWS,
        "matching": PAGE_ROWS + 30,
        "first": 1,
        "last": PAGE_ROWS,
    }
    assert [r["run_id"] for r in doc["runs"]] == ids[:PAGE_ROWS]
    assert doc["best"] == {"run_id": ids[0], "metric": 0.0}
    assert doc["counts"]["FINISHED"] == 55 and doc["counts"]["RUNNING"] == 55

    doc = sweep_document(model, sweep_store, states=frozenset({"PENDING", "RUNNING"}), page=2)
    assert doc["filter"] == ["PENDING", "RUNNING"]
    assert doc["page"]["matching"] == 75 and doc["page"]["number"] == 1  # past the last: last
    assert {r["state"] for r in doc["runs"]} == {"PENDING", "RUNNING"}
    assert [r["index"] for r in doc["runs"]] == sorted(r["index"] for r in doc["runs"])

    doc = sweep_document(model, sweep_store, states=frozenset({"FINISHED"}))
    assert len(doc["runs"]) == 55 and doc["page"]["pages"] == 1
    assert doc["sweep"]["name"] == EVIL and EVIL in doc["header"]


def test_the_query_names_states_and_a_page() -> None:
    assert parse_query("") == (frozenset(), 1)
    assert parse_query("state=RUNNING&state=failed&page=3") == (
        frozenset({"RUNNING", "FAILED"}),
        3,
    )
    assert parse_query("state=RUNNING,PREEMPTED&t=1") == (frozenset({"RUNNING", "PREEMPTED"}), 1)
    for bad, said in (
        ("state=LOST", "is not a run state; use PENDING"),
        ("page=0", "page='0' is not valid"),
        ("page=-1", "is not valid"),
        ("page=%D9%A3", "is not valid"),  # an Arabic-Indic three: not an ASCII number
        ("sort=x", "unknown query field 'sort'"),
        ("state=" + "%1b[31m", "\\x1b"),
    ):
        with pytest.raises(ConfigError, match=re.escape(said)):
            parse_query(bad)
    assert query_of(frozenset()) == ""
    assert query_of(frozenset({"FAILED", "RUNNING"}), 2) == "?state=RUNNING&state=FAILED&page=2"
    assert parse_query(query_of(frozenset({"FAILED"}), 4)[1:]) == (frozenset({"FAILED"}), 4)


# -- the charts -------------------------------------------------------------------------------
def test_a_chart_is_escaped_svg_with_its_markers() -> None:
    chart = Chart(
        title=EVIL,
        x_label="step",
        y_label='"><img src=x onerror=alert(1)>',
        series=[Series(EVIL, [(0, 1.0), (10, 0.5), (20, float("nan")), (30, 0.25)], "#123")],
        markers=[Marker(10, f"preempted {EVIL}", "preempted", "#c98f00")],
    )
    svg = render(chart)
    root = ET.fromstring(svg)  # well-formed XML: the browser's DOMParser takes it too
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert EVIL not in svg and "<img" not in svg and "style=" not in svg
    assert "&lt;script&gt;" in svg
    ns = {"s": "http://www.w3.org/2000/svg"}
    marks = root.findall(".//s:g[@class='marker marker-preempted']", ns)
    assert len(marks) == 1 and marks[0].get("data-step") == "10"
    line = root.find(".//s:polyline", ns)
    assert line is not None and len(line.get("points", "").split()) == 3  # the NaN left out
    empty = ET.fromstring(render(Chart("t", "x", "y", [Series("s", [], "#000")])))
    assert "nothing reported yet" in "".join(empty.itertext())


def test_envelope_keeps_the_shape_within_its_limit() -> None:
    points = [(float(i), float((i * 7919) % 1000)) for i in range(100_000)]
    points[54_321] = (54_321.0, -5.0)
    kept = envelope(points, 400)
    assert len(kept) <= 400 and kept[0] == points[0] and kept[-1] == points[-1]
    assert (54_321.0, -5.0) in kept and max(v for _, v in kept) == 999.0
    assert envelope(points[:10], 400) == points[:10]
    assert nice_ticks(0, 1) == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert nice_ticks(3, 3) == [3]


# -- a run ------------------------------------------------------------------------------------
def test_interruptions_mark_each_stop_and_each_resume() -> None:
    marks = interruptions(
        [
            attempt_row(1, "PREEMPTED", 30),
            attempt_row(2, "CRASHED", None),  # lost before it saved: the next resumes from 30
            attempt_row(3, "PREEMPTED", 55),
            attempt_row(4, None, None),
        ]
    )
    assert [(m["kind"], m["attempt"], m["step"]) for m in marks] == [
        ("preempted", 1, 30),
        ("resumed", 2, 30),
        ("resumed", 3, 30),
        ("preempted", 3, 55),
        ("resumed", 4, 55),
    ]
    over = interruptions([attempt_row(1, "FAILED", None), attempt_row(2, "FINISHED", 10)])
    assert [(m["kind"], m["step"], m["label"]) for m in over] == [
        ("resumed", 0, "attempt 2 started over from step 0")
    ]


def test_a_run_document_reads_its_files_bounded_and_escaped(
    sweep_store: Store, tmp_path: Path, sweep_clock: Clock
) -> None:
    sweep, ids = _sweep(sweep_store, 2)
    other, _ = _sweep(sweep_store, 1)
    c = _claim(sweep_store, sweep)
    _end(sweep_store, c, "PREEMPTED", 30, 0.7)
    c2 = _claim(sweep_store, sweep)
    home = tmp_path / "home"
    run_dir = home / "runs" / c.run_id
    (run_dir / "attempt-1").mkdir(parents=True)
    (run_dir / "attempt-2").mkdir()
    (run_dir / "attempts.jsonl").write_text(
        "x" * (1 << 17) + "\n" + f'{{"attempt": 1, "note": "{EVIL}\\u001b[2J"}}\n'
    )
    (run_dir / "attempt-1" / "record.json").write_text(f'{{"state": "{EVIL}", "step": 30}}')
    os.mkfifo(run_dir / "attempt-2" / "record.json")  # would block a careless reader
    doc = run_document(sweep_store, sweep_id=sweep, run_id=c2.run_id, home=home, metric="loss")
    assert doc is not None
    assert doc["state"] == "RUNNING" and doc["attempts"] == 2 and doc["checkpoint_step"] == 30
    assert [(m["kind"], m["step"]) for m in doc["marks"]] == [("preempted", 30), ("resumed", 30)]
    journal = doc["files"]["journal"]
    assert len(journal) == 1 and EVIL in journal[0] and "\x1b" not in journal[0]
    records = {r["attempt"]: r["text"] for r in doc["files"]["records"]}
    assert records[2] is None and EVIL in records[1] and '"step": 30' in records[1]

    page = render_run_page(doc, nonce="n0nce")
    assert EVIL not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert page.count("<script") == 1 and '<script nonce="n0nce">' in page
    assert 'class="ending-PREEMPTED"' in page and "2 (from step 30)" in page

    for bad in ("../x", "a/b", "", "-x", "x" * 200, ids[1] + "\n", c.run_id + "/.."):
        assert (
            run_document(sweep_store, sweep_id=sweep, run_id=bad, home=home, metric="loss") is None
        )
    assert (
        run_document(sweep_store, sweep_id=other, run_id=c.run_id, home=home, metric="loss") is None
    )


def test_the_page_escapes_what_the_queue_holds(sweep_store: Store) -> None:
    spec = {**SPEC, "metric": {"name": EVIL, "goal": "minimize"}}
    sweep, ids = _sweep(sweep_store, 2, spec)
    sweep_store.add_runs(sweep, [{"tag": '"><svg onload=alert(1)>'}])
    c = _claim(sweep_store, sweep)
    sweep_store.finish(
        c.run_id,
        agent="a",
        attempt=1,
        ending="FINISHED",
        exit_code=0,
        duration=1.0,
        checkpoint_step=3,
        summary={EVIL: 0.5},
    )
    model = SweepModel(sweep)
    states = frozenset({"FINISHED", "PENDING"})
    doc = sweep_document(model, sweep_store, states=states)
    page = render_page(doc, None, nonce="n0nce", chart=best_chart(model), states=states)
    assert EVIL not in page and "<svg onload" not in page
    assert page.count("<script") == 1
    assert 'value="FINISHED" checked' in page and 'value="RUNNING">' in page
    assert 'id="timeline"' in page and f'<g class="run" data-run="{ids[0]}">' in page
    assert 'class="attempt ending-FINISHED" data-attempt="1"' in page
    assert f'href="/run/{ids[0]}"' in page
    ET.fromstring(best_chart(model))


def test_the_timeline_draws_each_attempt_and_marks_the_stops() -> None:
    def attempt(n: int, start: float, end: float | None, ending: str | None) -> dict[str, Any]:
        return {"number": n, "started_at": start, "ended_at": end, "ending": ending, "lost": False}

    doc = {
        "now": 1400.0,
        "runs": [
            {"run_id": EVIL, "index": 1, "attempt_log": [attempt(1, 1000.0, 1100.0, "FINISHED")]},
            {
                "run_id": "r-0",
                "index": 0,
                "attempt_log": [
                    attempt(1, 1000.0, 1200.0, "PREEMPTED"),
                    attempt(2, 1210.0, None, None),
                ],
            },
            {"run_id": "r-2", "index": 2, "attempt_log": []},
        ],
    }
    svg = timeline_svg(doc)
    root = ET.fromstring(svg)
    ns = {"s": "http://www.w3.org/2000/svg"}
    rows = root.findall(".//s:g[@class='run']", ns)
    assert [g.get("data-run") for g in rows] == ["r-0", EVIL, "r-2"]  # by index
    bars = rows[0].findall("s:rect", ns)
    assert [b.get("class") for b in bars] == ["attempt ending-PREEMPTED", "attempt ending-None"]
    # the running attempt reaches now: the right edge of the plot
    assert float(bars[1].get("x", 0)) + float(bars[1].get("width", 0)) == pytest.approx(900 - 16)
    assert len(rows[0].findall("s:path[@class='stop']", ns)) == 1
    assert EVIL not in svg and "time since the first attempt shown (min)" in svg
    assert "no attempt yet" in timeline_svg({"now": 0.0, "runs": []})
