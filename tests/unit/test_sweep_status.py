"""``preemptible status``'s document, table and timeline, read from a real SQLite sweep queue.

The runs go through the real Store API (claim, finish, heartbeat, lease expiry). The
database sweep_clock (``preemptible_now()``, time.time of the SQLite backend) is replaced by a
clock the test sets, so every time, age and duration in the document is known exactly.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import sqlite3
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.text import Text

from preemptible import ConfigError
from preemptible._errors import StoreError
from preemptible._text import format_age
from preemptible.sweeps.status._render import format_params, render, render_sweeps
from preemptible.sweeps.status._snapshot import (
    snapshot,
    sweeps_snapshot,
    table_snapshot,
    write_json,
)
from preemptible.sweeps.status._status import watch
from preemptible.sweeps.status._timeline import plot_timeline, timeline_figure
from preemptible.sweeps.store._queue import Store, open_store
from preemptible.sweeps.store._rows import Claim
from tests.support.sweep_queue import SPEC, Clock

pytestmark = pytest.mark.timeout(60)


def claim(sweep_store: Store, sweep: str, agent: str, host: str, lease: float = 60) -> Claim:
    c = sweep_store.claim(sweep, agent=agent, host=host, lease=lease, propose=None)
    assert c is not None
    return c


def finish(sweep_store: Store, c: Claim, agent: str, ending: str, **values: Any) -> str:
    return sweep_store.finish(c.run_id, agent=agent, attempt=c.attempt, ending=ending, **values)


def busy_sweep(sweep_store: Store, sweep_clock: Clock) -> str:
    """Five runs: 0 finished; 1 preempted then finished (the best); 2 failed, its summary
    without the metric; 3 preempted, lost its agent, running again; 4 never claimed."""
    sweep = sweep_store.create_sweep(
        SPEC, name="demo", run_cap=10, max_failures=0, max_preemptions=5
    )
    sweep_store.add_runs(
        sweep,
        [
            {"lr": 0.1, "model": {"depth": 2, "act": "relu"}},
            {"lr": 0.01, "model": {"depth": 4, "act": "gelu"}},
            {"lr": 0.5, "note": "x" * 60},
            {"lr": 0.001, "tag": "[red]markup[/red]"},
            {"lr": 0.2},
        ],
    )
    sweep_clock.now = 1010.0
    c0 = claim(sweep_store, sweep, "a1", "h1")
    c1 = claim(sweep_store, sweep, "a2", "h2")
    assert (c0.index, c1.index) == (0, 1)
    sweep_clock.now = 1040.0
    assert finish(sweep_store, c1, "a2", "PREEMPTED", **ended(143, 30.0, 20)) == "PENDING"
    sweep_clock.now = 1050.0
    c1b = claim(sweep_store, sweep, "a3", "h3")  # the preempted run comes back first
    assert (c1b.index, c1b.attempt) == (1, 2)
    sweep_clock.now = 1060.0
    c2 = claim(sweep_store, sweep, "a4", "h4")
    sweep_clock.now = 1065.0
    assert finish(sweep_store, c2, "a4", "FAILED", **ended(1, 5.0, None, {"acc": 0.1})) == "FAILED"
    sweep_clock.now = 1110.0
    assert (
        finish(sweep_store, c0, "a1", "FINISHED", **ended(0, 100.0, 50, {"loss": 0.5}))
        == "FINISHED"
    )
    sweep_clock.now = 1150.0
    assert finish(
        sweep_store, c1b, "a3", "FINISHED", **ended(0, 100.0, 60, {"loss": 0.25, "acc": 0.9})
    )
    sweep_clock.now = 1200.0
    c3 = claim(sweep_store, sweep, "a5", "h5")
    assert c3.index == 3
    sweep_clock.now = 1250.0
    assert finish(sweep_store, c3, "a5", "PREEMPTED", **ended(143, 50.0, 40)) == "PENDING"
    sweep_clock.now = 1260.0
    c3b = claim(sweep_store, sweep, "a6", "h6", lease=10)
    assert (c3b.index, c3b.attempt) == (3, 2)
    sweep_clock.now = 1265.0
    assert sweep_store.expire_leases() == []  # its renewals are watched from here (``_watch``)
    sweep_clock.now = 1300.0
    assert sweep_store.expire_leases() == [c3b.run_id]  # its agent vanished
    sweep_clock.now = 1310.0
    c3c = claim(sweep_store, sweep, "a7", "h7")
    assert (c3c.index, c3c.attempt) == (3, 3)
    sweep_store.report(c3c.run_id, {"loss": 0.125})  # better than the best, but not finished
    sweep_clock.now = 1350.0
    sweep_store.heartbeat(c3c.run_id, agent="a7", lease=60, attempt=3)
    return sweep


def ended(
    code: int, duration: float, step: int | None, summary: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"exit_code": code, "duration": duration, "checkpoint_step": step, "summary": summary}


def attempt(
    number: int,
    agent: str,
    started: float,
    end: float | None,
    ending: str | None,
    code: int | None,
    duration: float,
    step: int | None,
    lost: bool = False,
) -> dict[str, Any]:
    return {
        "number": number,
        "agent": agent,
        "host": "h" + agent[1:],
        "started_at": started,
        "ended_at": end,
        "ending": ending,
        "lost": lost,
        "late": False,
        "exit_code": code,
        "duration": duration,
        "checkpoint_step": step,
    }


# -- the document -----------------------------------------------------------------------------
def test_snapshot_is_the_exact_document(sweep_store: Store, sweep_clock: Clock) -> None:
    sweep = busy_sweep(sweep_store, sweep_clock)
    doc = snapshot(sweep_store, sweep, now=1400.0)
    assert json.loads(json.dumps(doc)) == doc  # plain JSON data
    assert list(doc) == ["sweep", "runs"]
    assert doc["sweep"] == {
        "id": sweep,
        "name": "demo",
        "control": "running",
        "method": "random",
        "metric": {"name": "loss", "goal": "minimize"},
        "run_cap": 10,
        "runs_created": 5,
        "counts": {
            "PENDING": 1,
            "RUNNING": 1,
            "FINISHED": 2,
            "PREEMPTED": 0,
            "FAILED": 1,
            "CRASHED": 0,
            "KILLED": 0,
            "CANCELLED": 0,
            "STOPPED": 0,
        },
        "best": {"run_id": f"{sweep}-1", "metric": 0.25},
        "target": None,
        "created_at": 1000.0,
        "unreadable": [],
    }
    runs = doc["runs"]
    assert [list(r) for r in runs] == [
        [
            *("run_id", "index", "params", "state", "attempts", "preemptions", "failures"),
            *("checkpoint_step", "metric", "summary", "agent", "host", "heartbeat_age"),
            *("duration", "attempt_log", "unreadable"),
        ]
    ] * 5
    assert [r["unreadable"] for r in runs] == [[]] * 5
    short = [
        {k: r[k] for k in list(r)[:14] if k not in ("run_id", "params", "summary")} for r in runs
    ]
    assert short == [
        {"index": 0, "state": "FINISHED", "attempts": 1, "preemptions": 0, "failures": 0,
         "checkpoint_step": 50, "metric": 0.5, "agent": "a1", "host": "h1",
         "heartbeat_age": None, "duration": 100.0},
        {"index": 1, "state": "FINISHED", "attempts": 2, "preemptions": 1, "failures": 0,
         "checkpoint_step": 60, "metric": 0.25, "agent": "a3", "host": "h3",
         "heartbeat_age": None, "duration": 130.0},
        {"index": 2, "state": "FAILED", "attempts": 1, "preemptions": 0, "failures": 1,
         "checkpoint_step": None, "metric": None, "agent": "a4", "host": "h4",
         "heartbeat_age": None, "duration": 5.0},
        # newest attempt with a checkpoint: the first (the lost one and the running one have
        # none); running for 90 s, last heartbeat 50 s ago; the lost attempt held it 40 s
        {"index": 3, "state": "RUNNING", "attempts": 3, "preemptions": 2, "failures": 0,
         "checkpoint_step": 40, "metric": 0.125, "agent": "a7", "host": "h7",
         "heartbeat_age": 50.0, "duration": 180.0},
        {"index": 4, "state": "PENDING", "attempts": 0, "preemptions": 0, "failures": 0,
         "checkpoint_step": None, "metric": None, "agent": None, "host": None,
         "heartbeat_age": None, "duration": 0.0},
    ]  # fmt: skip
    assert [r["run_id"] for r in runs] == [f"{sweep}-{i}" for i in range(5)]
    assert runs[0]["params"] == {"lr": 0.1, "model": {"depth": 2, "act": "relu"}}
    assert [r["summary"] for r in runs] == [
        {"loss": 0.5},
        {"loss": 0.25, "acc": 0.9},
        {"acc": 0.1},
        {"loss": 0.125},
        None,
    ]
    assert [r["attempt_log"] for r in runs] == [
        [attempt(1, "a1", 1010.0, 1110.0, "FINISHED", 0, 100.0, 50)],
        [
            attempt(1, "a2", 1010.0, 1040.0, "PREEMPTED", 143, 30.0, 20),
            attempt(2, "a3", 1050.0, 1150.0, "FINISHED", 0, 100.0, 60),
        ],
        [attempt(1, "a4", 1060.0, 1065.0, "FAILED", 1, 5.0, None)],
        [
            attempt(1, "a5", 1200.0, 1250.0, "PREEMPTED", 143, 50.0, 40),
            attempt(2, "a6", 1260.0, 1300.0, "CRASHED", None, 40.0, None, lost=True),
            attempt(3, "a7", 1310.0, None, None, None, 90.0, None),
        ],
        [],
    ]


@pytest.mark.parametrize(
    ("goal", "best_index", "value"), [("minimize", 0, 0.2), ("maximize", 1, 0.9)]
)
def test_best_follows_the_goal_among_finished_runs(
    sweep_store: Store, sweep_clock: Clock, goal: str, best_index: int, value: float
) -> None:
    spec = {**SPEC, "metric": {"name": "acc", "goal": goal}}
    sweep = sweep_store.create_sweep(
        spec, name=None, run_cap=None, max_failures=0, max_preemptions=1
    )
    sweep_store.add_runs(sweep, [{"lr": 0.1}, {"lr": 0.2}, {"lr": 0.3}, {"lr": 0.4}])
    for agent, acc, ending in (("a", 0.2, "FINISHED"), ("b", 0.9, "FINISHED"), ("c", 0.95, "")):
        c = claim(sweep_store, sweep, agent, "h")
        if ending:
            finish(sweep_store, c, agent, ending, **ended(0, 1.0, None, {"acc": acc}))
        else:  # still running, with a better value than any finished run: not the best
            sweep_store.report(c.run_id, {"acc": acc if goal == "maximize" else 0.01})
    c = claim(
        sweep_store, sweep, "d", "h"
    )  # failed with the best value of all: not the best either
    finish(
        sweep_store,
        c,
        "d",
        "FAILED",
        **ended(1, 1.0, None, {"acc": 0.0 if goal == "minimize" else 1.0}),
    )
    doc = snapshot(sweep_store, sweep)
    assert doc["sweep"]["best"] == {"run_id": f"{sweep}-{best_index}", "metric": value}
    assert doc["sweep"]["metric"] == {"name": "acc", "goal": goal}


def test_a_sweep_without_runs_and_without_a_metric(sweep_store: Store, sweep_clock: Clock) -> None:
    spec = {"method": "grid", "parameters": {"x": {"values": [1]}}}
    sweep = sweep_store.create_sweep(
        spec, name=None, run_cap=None, max_failures=0, max_preemptions=1
    )
    doc = snapshot(sweep_store, sweep, now=1060.0)
    assert doc["runs"] == []
    assert doc["sweep"]["metric"] is None and doc["sweep"]["best"] is None
    assert set(doc["sweep"]["counts"].values()) == {0}
    text = show(render(doc, now=1060.0))
    assert f"sweep {sweep} · running · grid · 0 runs · created 1m00s ago" in text
    assert "no runs yet" in text
    assert "metric" in text  # the column without a spec metric

    sweep_store.add_runs(sweep, [{"x": 1}])
    c = claim(sweep_store, sweep, "a1", "h1")
    finish(sweep_store, c, "a1", "FINISHED", **ended(0, 3.0, None, {"loss": 1.0}))
    doc = snapshot(sweep_store, sweep)
    assert doc["runs"][0]["metric"] is None and doc["sweep"]["best"] is None


def test_an_unknown_sweep_is_one_clear_error(sweep_store: Store) -> None:
    with pytest.raises(ConfigError, match="no sweep 'nope' in sqlite://"):
        snapshot(sweep_store, "nope")


# -- the tables -------------------------------------------------------------------------------
def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.split("│")]


def show(renderable: Any) -> str:
    console = Console(record=True, width=160)
    console.print(renderable)
    return console.export_text()


def test_render_shows_every_column(sweep_store: Store, sweep_clock: Clock) -> None:
    sweep = busy_sweep(sweep_store, sweep_clock)
    group = render(snapshot(sweep_store, sweep, now=1400.0), now=1400.0)
    text = show(group)
    header = text.splitlines()[0]
    assert header == (
        f"sweep {sweep} 'demo' · running · random · minimize loss · 5/10 runs: 1 PENDING, "
        f"1 RUNNING, 2 FINISHED, 1 FAILED · best {sweep}-1 loss=0.25 · created 6m40s ago"
    )
    rows = {c[0]: c for c in map(cells, text.splitlines()) if c[0].startswith(f"{sweep}-")}
    assert list(rows.values()) == [
        [
            *(f"{sweep}-0", "lr=0.1 model.act=relu model.depth=2", "FINISHED", "1"),
            *("50", "0.5", "a1@h1", "-", "1m40s"),
        ],
        [
            *(f"{sweep}-1", "lr=0.01 model.act=gelu model.depth=4", "FINISHED", "2 (1p)"),
            *("60", "0.25", "a3@h3", "-", "2m10s"),
        ],
        [
            *(f"{sweep}-2", f"lr=0.5 note={'x' * 23}…", "FAILED", "1 (1f)"),
            *("-", "-", "a4@h4", "-", "5s"),
        ],
        [
            *(f"{sweep}-3", "lr=0.001 tag=[red]markup[/red]", "RUNNING", "3 (2p)"),
            *("40", "0.125", "a7@h7", "50s", "3m00s"),
        ],
        [f"{sweep}-4", "lr=0.2", "PENDING", "0", "-", "-", "-", "-", "-"],
    ]
    assert "loss ↓" in text

    table = group.renderables[1]
    states = [cell for cell in table.columns[2].cells]
    assert [(s.plain, str(s.style)) for s in states] == [
        ("FINISHED", "green"),
        ("FINISHED", "green"),
        ("FAILED", "red"),
        ("RUNNING", "blue"),
        ("PENDING", "dim"),
    ]
    metric = list(table.columns[5].cells)
    assert [str(m.spans[0].style) if m.spans else "" for m in metric] == ["", "bold", "", "", ""]


def test_render_sorts_by_index_and_colours_every_state() -> None:
    states = ["CANCELLED", "KILLED", "CRASHED", "PREEMPTED"]
    doc = {
        "sweep": {
            "id": "s1",
            "name": None,
            "control": "cancelled",
            "method": None,
            "metric": {"name": "acc", "goal": "maximize"},
            "run_cap": None,
            "runs_created": 4,
            "counts": {s: 1 for s in states},
            "best": None,
            "created_at": 0.0,
        },
        "runs": [
            {
                "run_id": f"s1-{i}",
                "index": i,
                "params": {},
                "state": state,
                "attempts": 1,
                "preemptions": 0,
                "failures": 0,
                "checkpoint_step": None,
                "metric": None,
                "summary": None,
                "agent": "a",
                "host": "h",
                "heartbeat_age": None,
                "duration": 3725.0 + 86400 * i,
                "attempt_log": [],
            }
            for i, state in reversed(list(enumerate(states)))
        ],
    }
    table = render(doc, now=90000.0).renderables[1]
    cells = list(table.columns[2].cells)
    assert [(c.plain, str(c.style)) for c in cells] == [
        ("CANCELLED", "grey50"),
        ("KILLED", "red"),
        ("CRASHED", "yellow"),
        ("PREEMPTED", "yellow"),
    ]
    assert [c.plain for c in table.columns[8].cells] == ["1h02m", "1d01h", "2d01h", "3d01h"]
    assert "acc ↑" in show(table)


def test_sweeps_snapshot_and_table(sweep_store: Store, sweep_clock: Clock) -> None:
    assert sweeps_snapshot(sweep_store) == []
    assert "no sweeps yet" in show(render_sweeps([]))
    first = busy_sweep(sweep_store, sweep_clock)
    sweep_clock.now = 2000.0
    second = sweep_store.create_sweep(
        {"method": "grid", "parameters": {"x": {"values": [1]}}},
        name=None,
        run_cap=None,
        max_failures=0,
        max_preemptions=1,
    )
    rows = sweeps_snapshot(sweep_store)
    assert rows[0] == snapshot(sweep_store, first)["sweep"]
    assert [r["id"] for r in rows] == [first, second]
    assert rows[1]["runs_created"] == 0 and rows[1]["best"] is None
    text = show(render_sweeps(rows))
    lines = {c[0]: c for c in map(cells, text.splitlines()) if c[0] in (first, second)}
    assert lines[first][:-1] == [
        *(first, "demo", "running", "random", "minimize loss", "5/10"),
        *("1 PENDING, 1 RUNNING, 2 FINISHED, 1 FAILED", f"{first}-1 0.25"),
    ]
    assert lines[second][:-1] == [second, "-", "running", "grid", "-", "0", "-", "-"]
    assert lines[first][-1].startswith("1970-01-01 ")  # created at 1000 s after the epoch


def test_formatting_helpers() -> None:
    assert format_params({"a": {"b": {"c": 1}}, "d": [1, 2], "e": True, "f": None}) == (
        "a.b.c=1 d=[1,2] e=true f=null"
    )
    assert (
        format_params({"s": "two\nlines", "x": 1e-5, "empty": {}}) == "s=two lines x=1e-05 empty={}"
    )
    assert format_params({"long": "y" * 30}) == "long=" + "y" * 23 + "…"
    assert [format_age(s) for s in (None, -3, 0, 59.9, 60, 192, 3599, 3600, 7500, 86400 * 3)] == [
        *("-", "0s", "0s", "59s", "1m00s", "3m12s", "59m59s", "1h00m", "2h05m", "3d00h")
    ]


# -- the timeline -----------------------------------------------------------------------------
def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def bars(figure: Any) -> list[tuple[float, float, float]]:
    """(row, start, length) of every bar drawn."""
    (ax,) = figure.axes
    (drawn,) = [c for c in ax.collections if c.get_gid() == "attempts"]
    boxes = [path.get_extents() for path in drawn.get_paths()]
    return [(float(b.y0 + b.y1) / 2, float(b.x0), float(b.width)) for b in boxes]


def preemption_marks(figure: Any) -> list[tuple[float, float]]:
    (ax,) = figure.axes
    (marks,) = [c for c in ax.collections if c.get_gid() == "preemptions"]
    return [(float(x), float(y)) for x, y in marks.get_offsets()]


def test_timeline_draws_one_bar_per_attempt(
    sweep_store: Store, sweep_clock: Clock, tmp_path: Path
) -> None:
    sweep = busy_sweep(sweep_store, sweep_clock)
    doc = snapshot(sweep_store, sweep, now=1400.0)
    figure = timeline_figure(doc)
    assert len(bars(figure)) == sum(r["attempts"] for r in doc["runs"]) == 7
    (ax,) = figure.axes
    assert ax.get_xlabel() == "time since the first attempt (min)"  # 390 s in all
    seconds = [(row, round(x * 60, 6), round(w * 60, 6)) for row, x, w in bars(figure)]
    assert seconds == [  # (row, seconds since the first attempt started at 1010, length)
        (0, 0, 100),
        *((1, 0, 30), (1, 40, 100)),
        (2, 50, 5),
        *((3, 190, 50), (3, 250, 40), (3, 300, 90)),  # preempted, lost, running for 90 s
    ]
    # run 1's preemption at 1040, run 3's at 1250 and its lost lease at 1300 (y = row)
    assert sorted(preemption_marks(figure)) == [
        (0.5, 1.0),
        (4.0, 3.0),
        (pytest.approx(290 / 60), 3.0),
    ]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"{sweep}-{i}" for i in range(5)]
    assert ax.get_title() == f"sweep {sweep} (demo)"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["FINISHED", "PREEMPTED", "CRASHED", "FAILED", "still running", "preemption"]

    out = plot_timeline(doc, tmp_path / "timeline.png")
    assert out == tmp_path / "timeline.png"
    width, height = png_size(out)
    assert width == 1000 and 250 <= height <= 600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db", "timeline.png"]
    assert plot_timeline(doc, tmp_path / "timeline.svg").read_text().startswith("<?xml")


def test_timeline_of_a_sweep_without_attempts(
    sweep_store: Store, sweep_clock: Clock, tmp_path: Path
) -> None:
    sweep = sweep_store.create_sweep(
        SPEC, name=None, run_cap=None, max_failures=0, max_preemptions=1
    )
    doc = snapshot(sweep_store, sweep)
    assert bars(timeline_figure(doc)) == []
    assert png_size(plot_timeline(doc, tmp_path / "empty.png"))[0] == 1000
    sweep_store.add_runs(sweep, [{"lr": 0.1}])
    doc = snapshot(sweep_store, sweep)
    figure = timeline_figure(doc)
    assert bars(figure) == [] and preemption_marks(figure) == []
    assert png_size(plot_timeline(doc, tmp_path / "pending.png"))[0] == 1000


def test_timeline_refuses_bad_paths_in_one_line(
    sweep_store: Store, sweep_clock: Clock, tmp_path: Path
) -> None:
    sweep = sweep_store.create_sweep(
        SPEC, name=None, run_cap=None, max_failures=0, max_preemptions=1
    )
    doc = snapshot(sweep_store, sweep)
    missing = tmp_path / "no" / "such" / "t.png"
    with pytest.raises(ConfigError, match=r"directory .*/no/such' does not exist") as info:
        plot_timeline(doc, missing)
    for bad in ("t.xyz", "timeline"):
        with pytest.raises(ConfigError, match=r"cannot write .*use a suffix among .*\.png") as info:
            plot_timeline(doc, tmp_path / bad)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="is a directory"):
        plot_timeline(doc, tmp_path)
    # a real write error (here: a directory where the temporary file would go)
    out = tmp_path / "out"
    (out / f".t.png.{os.getpid()}.tmp").mkdir(parents=True)
    (out / "t.png").write_bytes(b"the previous plot")
    with pytest.raises(ConfigError, match=r"t\.png': cannot write: Is a directory$"):
        plot_timeline(doc, out / "t.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db", "out"]
    assert sorted(p.name for p in out.iterdir()) == [f".t.png.{os.getpid()}.tmp", "t.png"]
    assert (out / "t.png").read_bytes() == b"the previous plot"  # untouched


def test_timeline_without_matplotlib_names_the_extra(
    sweep_store: Store, sweep_clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sweep = sweep_store.create_sweep(
        SPEC, name=None, run_cap=None, max_failures=0, max_preemptions=1
    )
    doc = snapshot(sweep_store, sweep)
    for name in [n for n in sys.modules if n.split(".")[0] == "matplotlib"] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    with pytest.raises(ConfigError, match=r"needs matplotlib; pip install 'preemptible\[plot\]'"):
        plot_timeline(doc, tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


# -- a database on a read-only file system ----------------------------------------------------
def _unshare() -> list[str] | None:
    """How to get a mount namespace of our own (to mount a directory read-only), or None."""
    for command in (["unshare", "-m"], ["unshare", "-rm"]):
        try:
            if subprocess.run([*command, "true"], capture_output=True, timeout=30).returncode == 0:
                return command
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


def status_read_only(folder: Path, *commands: list[str]) -> list[str]:
    """Run ``preemptible status ...`` for each of ``commands`` with ``folder`` mounted
    read-only (in a mount namespace of its own); their outputs."""
    unshare = _unshare()
    if unshare is None:
        pytest.skip("no mount namespace here (unshare -m): cannot mount a folder read-only")
    runs = " && echo ===== && ".join(
        shlex.join([sys.executable, "-m", "preemptible", "status", *c]) for c in commands
    )
    script = f"mount --bind {folder} {folder} && mount -o remount,ro,bind {folder} && {runs}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
    out = subprocess.run(
        [*unshare, "sh", "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    return out.stdout.split("=====\n")


@pytest.mark.parametrize("layout", ["closed", "agents-writing", "wal-left-behind"])
def test_status_reads_a_database_on_a_read_only_file_system(tmp_path: Path, layout: str) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    db = folder / "sweeps.db"
    with open_store(f"sqlite://{db}") as s:
        sweep = s.create_sweep(SPEC, name="ro", run_cap=None, max_failures=0, max_preemptions=1)
        s.add_runs(sweep, [{"lr": 0.1}, {"lr": 0.2}])
        c = claim(s, sweep, "a1", "h1")
        finish(s, c, "a1", "FINISHED", **ended(0, 2.0, 5, {"loss": 0.5}))
    writer = None
    if layout != "closed":  # a commit that is only in the WAL (an agent still has it open)
        writer = sqlite3.connect(db, isolation_level=None)
        writer.execute("PRAGMA wal_autocheckpoint=0")
        writer.execute(
            "UPDATE preemptible_runs SET summary = ? WHERE id = ?", ('{"loss": 0.25}', c.run_id)
        )
    if layout == "wal-left-behind":  # the agents' machine died: -wal is there, -shm is not
        left = tmp_path / "left"
        left.mkdir()
        for suffix in ("", "-wal"):
            shutil.copyfile(f"{db}{suffix}", f"{left / 'sweeps.db'}{suffix}")
        folder, db = left, left / "sweeps.db"
    before = sorted(p.name for p in folder.iterdir())
    url = f"sqlite://{db}"
    table, as_json, listing = status_read_only(
        folder, [sweep, "--db", url], [sweep, "--json", "--db", url], ["--db", url]
    )
    loss = "0.5" if layout == "closed" else "0.25"
    assert f"best {c.run_id} loss={loss}" in table and "1 PENDING, 1 FINISHED" in table, table
    assert [r["metric"] for r in json.loads(as_json)["runs"]] == [float(loss), None]
    assert sweep in listing
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written
    if writer is not None:
        writer.close()


# -- narrow terminals and big sweeps ----------------------------------------------------------
@pytest.mark.parametrize("width", [30, 40, 49, 60, 80])
def test_the_state_of_every_run_is_shown_however_narrow_the_terminal(
    sweep_store: Store, sweep_clock: Clock, width: int
) -> None:
    sweep = busy_sweep(sweep_store, sweep_clock)
    doc = snapshot(sweep_store, sweep, now=1400.0)
    console = Console(record=True, width=width)
    console.print(render(doc, now=1400.0, width=width))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= width, text
    states = [line for line in text.splitlines() if f"{sweep}-" in line and "│" in line]
    assert [s for s in ("FINISHED", "FINISHED", "FAILED", "RUNNING", "PENDING") if s] == [
        next(w for w in ("FINISHED", "FAILED", "RUNNING", "PENDING") if w in line)
        for line in states
    ], text
    listing = Console(record=True, width=width)
    listing.print(render_sweeps(sweeps_snapshot(sweep_store), width=width))
    assert "1 PENDING" in listing.export_text() or "1 PENDING," in listing.export_text()


def test_a_big_sweep_shows_the_runs_worth_seeing_and_counts_the_others(
    sweep_store: Store, sweep_clock: Clock
) -> None:
    sweep = sweep_store.create_sweep(
        SPEC, name=None, run_cap=None, max_failures=0, max_preemptions=5
    )
    sweep_store.add_runs(sweep, [{"lr": i / 100} for i in range(40)])
    # 0-29 finished (29 the best), 30-33 failed, 34-35 requeued, 36-37 running, 38-39 pending
    taken = [claim(sweep_store, sweep, f"a{i}", "h") for i in range(38)]
    for i, c in enumerate(taken[:36]):
        sweep_clock.now = 1100.0 + i
        if i < 30:
            finish(
                sweep_store, c, f"a{i}", "FINISHED", **ended(0, 1.0, None, {"loss": 1.0 - i / 100})
            )
        elif i < 34:
            finish(sweep_store, c, f"a{i}", "FAILED", **ended(1, 1.0, None))
        else:
            finish(sweep_store, c, f"a{i}", "PREEMPTED", **ended(143, 1.0, 3))
    doc = table_snapshot(sweep_store, sweep, now=2000.0, limit=10)
    shown = [r["index"] for r in doc["runs"]]
    assert shown == sorted(shown) and len(shown) == 10
    assert {36, 37, 29, 33, 32, 31} <= set(shown)  # running, the best, the latest failed
    assert {34, 35} & set(shown)  # requeued
    assert doc["sweep"]["counts"]["FINISHED"] == 30 and doc["hidden"]["runs"] == 30
    hidden = doc["hidden"]["counts"]
    assert sum(hidden.values()) == 30 and hidden["RUNNING"] == 0
    text = show(render(doc, now=2000.0))
    assert "30 more runs not shown: " in text and "--json lists every run" in text
    full = table_snapshot(sweep_store, sweep, now=2000.0, limit=40)
    assert "hidden" not in full and full["runs"] == snapshot(sweep_store, sweep, now=2000.0)["runs"]


def test_json_streams_the_same_document_as_the_snapshot(
    sweep_store: Store, sweep_clock: Clock
) -> None:
    sweep = busy_sweep(sweep_store, sweep_clock)
    out = io.StringIO()
    write_json(sweep_store, sweep, out, now=1400.0)
    text = out.getvalue()
    assert json.loads(text) == snapshot(sweep_store, sweep, now=1400.0)
    assert len(text.splitlines()) == 2 + 5 + 1  # the sweep, "runs": [, a line per run, ]}


# -- --watch while the database is away -------------------------------------------------------
def test_watch_marks_the_last_table_while_the_database_is_away_and_recovers() -> None:
    frames: list[str] = []
    released = threading.Event()
    answers: list[Any] = [
        "table 1",
        "hang",
        StoreError("the sweep database x is unreachable"),
        "table 2",
    ]

    def look() -> Text:
        answer = answers.pop(0)
        if answer == "hang":  # a database that does not answer (a network cut)
            assert released.wait(30)
            answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return Text(answer)

    def show(view: Any) -> None:
        frames.append(show_text(view))
        if "no answer" in frames[-1]:
            released.set()  # the marker is up: now the look fails

    watch(look, 0.01, show, stale_after=0.2, rounds=3)
    assert frames[0] == "table 1"
    stale, failed, back = frames[1:]
    since = re.search(r"database unreachable since (\d\d:\d\d:\d\d), showing the last table \(of "
                      r"\d\d:\d\d:\d\d\)", stale)  # fmt: skip
    assert since is not None and "no answer for 0.2 s" in stale and stale.endswith("table 1"), stale
    assert f"unreachable since {since.group(1)}" in failed and "x is unreachable" in failed
    assert failed.endswith("table 1")
    assert back == "table 2"  # recovered: no marker


def show_text(view: Any) -> str:
    console = Console(record=True, width=200)
    console.print(view)
    return console.export_text().strip()


def test_watch_raises_a_bug_in_the_look() -> None:
    def look() -> Text:
        raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError):
        watch(look, 0.01, lambda view: None, rounds=1)


def test_json_stays_json_when_a_stored_number_overflows(
    sweep_store: Store, sweep_clock: Clock, tmp_path: Path
) -> None:
    sweep = sweep_store.create_sweep(
        SPEC, name=None, run_cap=None, max_failures=0, max_preemptions=1
    )
    (run_id,) = sweep_store.add_runs(sweep, [{"lr": 0.1}])
    with contextlib.closing(sqlite3.connect(tmp_path / "db" / "sweeps.db")) as db, db:
        db.execute("UPDATE preemptible_runs SET params = ? WHERE id = ?", ('{"lr": 1e999}', run_id))
    out = io.StringIO()
    write_json(sweep_store, sweep, out)

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    (run,) = json.loads(out.getvalue(), parse_constant=refuse)["runs"]
    assert run["params"] == {"lr": None}


def test_json_keeps_what_orjson_refuses_exact(
    sweep_store: Store, sweep_clock: Clock, tmp_path: Path
) -> None:
    # orjson encodes --json; an integer wider than 64 bits and a lone surrogate (text a hand
    # edit can leave) are written by the standard library, the value unchanged
    sweep = sweep_store.create_sweep(
        SPEC, name=None, run_cap=None, max_failures=0, max_preemptions=1
    )
    run_a, run_b = sweep_store.add_runs(sweep, [{"lr": 0.1}, {"lr": 0.2}])
    wide = 2**70 + 3
    with contextlib.closing(sqlite3.connect(tmp_path / "db" / "sweeps.db")) as db, db:
        for run_id, text in ((run_a, f'{{"seed": {wide}}}'), (run_b, '{"tag": "\\ud800é"}')):
            db.execute("UPDATE preemptible_runs SET params = ? WHERE id = ?", (text, run_id))
    out = io.StringIO()
    write_json(sweep_store, sweep, out)
    runs = {r["run_id"]: r for r in json.loads(out.getvalue())["runs"]}
    assert runs[run_a]["params"] == {"seed": wide}
    assert runs[run_b]["params"] == {"tag": "\ud800é"}
