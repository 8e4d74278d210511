"""``preemptible demo`` (the sweep): run for real in a temporary directory (the CLI, with
``--serve``), its story checked line by line, its outcome read back from the queue it used,
its web page read (and shown in the session's browser, where there is one) until Ctrl+C."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from preemptible._paths import HISTORY_NAME
from preemptible._report import read_history
from preemptible._states import RecordState
from preemptible.demo._sweep import SIGTERM_RUN, STOP_FILE_RUN, run_sweep_demo
from preemptible.sweeps.store._queue import open_store
from tests.conftest import Child
from tests.support.browser import SCREENSHOTS, Tab

SRC = Path(__file__).resolve().parents[2] / "src"


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if text.encode() in argv:
                found.append(int(entry.name))
    return found


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.timeout(300)
def test_the_demo_preempts_two_runs_resumes_each_bit_for_bit_and_serves_its_page(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    argv = ["demo", "--serve", "--port", "0", "--seed", "5", "--workdir", str(tmp_path)]
    demo = Child([sys.executable, "-m", "preemptible", *argv], env={"PYTHONPATH": str(SRC)})
    sweep_id = "no sweep yet"
    try:
        served = demo.wait_line(lambda line: line.startswith("serving sweep "), timeout=270)
        lines = demo.lines
        out = demo.output
        sweep = re.search(r"^  1\. sweep (\w+) created", out, re.MULTILINE)
        assert sweep, out
        sweep_id = sweep.group(1)
        home = tmp_path / ".preemptible"
        assert f"live web page: preemptible status {sweep_id} --db sqlite:///" in out
        assert f"--home {home} --serve" in out
        assert re.search(
            rf"SIGTERM to agent 1 during step \d+ of run {sweep_id}-{SIGTERM_RUN}: agent exit "
            "143, run PREEMPTED at step \\d+, back in the queue",
            out,
        ), out
        assert re.search(
            rf"stop file touched during step \d+ of run {sweep_id}-{STOP_FILE_RUN} \(agent "
            "[23]\\): run PREEMPTED at step \\d+, back in the queue",
            out,
        ), out
        verdicts = [line for line in lines if "the same run uninterrupted" in line]
        assert len(verdicts) == 2, out
        assert all("identical, bit for bit" in line for line in verdicts), out
        assert "DIFFERENT" not in out and "FAILED" not in out
        png = tmp_path / "timeline.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"timeline of the attempts: {png}" in out
        assert not _processes_mentioning(sweep_id), "agents still running while it serves"

        with open_store(f"sqlite:///{tmp_path}/queue.db") as store:
            runs = store.runs(sweep_id)
            attempts = {run.index: store.attempts(run.id) for run in runs}
            stored = {run.index: store.run_history(run.id) for run in runs}
        assert [run.state for run in runs] == ["FINISHED"] * 6
        for index, tries in attempts.items():
            preempted = index in (SIGTERM_RUN, STOP_FILE_RUN)
            endings = ["PREEMPTED", "FINISHED"] if preempted else ["FINISHED"]
            assert [a.ending for a in tries] == endings, (index, tries)
        stopped, resumed = attempts[SIGTERM_RUN]
        assert stopped.exit_code == 143 and resumed.agent != stopped.agent
        assert attempts[STOP_FILE_RUN][0].exit_code == 143  # a notice's code
        assert not list(tmp_path.glob("stop-agent-*"))  # taken by the run, or removed
        # each preempted run's stored loss history is the uninterrupted run's, point for point
        for index in (SIGTERM_RUN, STOP_FILE_RUN):
            params = runs[index].params
            name = "-".join(f"{k}{v}" for k, v in sorted(params.items()))
            reference, _ = read_history(tmp_path / "reference" / name / "run" / HISTORY_NAME)
            assert len(reference) > 10, name
            points = [(step, value) for step, value, _ in stored[index]["loss"]]
            assert points == [(step, value) for step, _, value in reference], index
            assert {a for _, _, a in stored[index]["loss"]} == {1, 2}  # both attempts reported

        # the page it serves: the sweep, and each preempted run with where it stopped and
        # resumed, its journal and records read from the demo's home
        url = re.search(r"at (http://\S+/)", served)
        assert url, served
        address = url.group(1)
        doc = _get(address + "api/sweep")
        assert doc["counts"]["FINISHED"] == 6 and doc["best"] is not None
        run = _get(f"{address}api/run/{sweep_id}-{SIGTERM_RUN}")
        step = stopped.checkpoint_step
        assert [(m["kind"], m["step"]) for m in run["marks"]] == [
            ("preempted", step),
            ("resumed", step),
        ]
        assert len(run["files"]["journal"]) == 2  # a line per attempt
        loss = run["curves"]["drawn"]["loss"]  # its curve, from both attempts
        assert {p[2] for p in loss["points"]} == {1, 2} and loss["count"] == len(loss["points"])
        assert f'"state": "{RecordState.STOPPED}"' in (run["files"]["records"][0]["text"] or "")
        _browse(request, address, sweep_id, tmp_path, step)
    finally:
        if demo.proc.poll() is None:
            demo.signal(signal.SIGINT)  # Ctrl+C: the page stops, the demo's own code is kept
        rc = demo.wait(30)
    assert rc == 0, demo.output
    assert demo.lines[-1] == "stopped (SIGINT)", demo.output
    assert not _processes_mentioning(sweep_id), "agents left running"


def _browse(
    request: pytest.FixtureRequest, address: str, sweep_id: str, tmp_path: Path, step: int | None
) -> None:
    """The demo's pages in the session's browser (where there is one): screenshots for the
    docs/sweeps.md (``make screenshots``)."""
    try:
        browser = request.getfixturevalue("browser")
    except pytest.skip.Exception as exc:
        if SCREENSHOTS:  # asked for the docs' pictures: no browser is a failure here
            raise AssertionError(f"PREEMPTIBLE_SCREENSHOTS is set, but: {exc}") from None
        return
    tab = Tab(browser)
    tab.page.goto(address)
    assert tab.page.locator("#runs tr").count() == 6
    tab.shoot(tmp_path, "status-page.png", readme=True)
    tab.page.goto(f"{address}run/{sweep_id}-{SIGTERM_RUN}")
    assert tab.page.locator("#attempts tr.ending-PREEMPTED").count() == 1
    loss = tab.page.locator('#curves figure[data-metric="loss"]')
    assert loss.locator('g[data-marker="preempted"]').get_attribute("data-step") == str(step)
    assert loss.locator('g[data-marker="resumed"]').get_attribute("data-step") == str(step)
    tab.shoot(tmp_path, "status-run-page.png", readme=True)
    tab.close()


@pytest.mark.timeout(60)
def test_a_demo_that_cannot_go_on_says_why_and_exits_1(tmp_path: Path) -> None:
    (tmp_path / "queue.db").mkdir()  # the queue cannot be created there
    lines: list[str] = []
    assert run_sweep_demo(tmp_path, seed=1, echo=lines.append) == 1
    failed = [line for line in lines if "FAILED" in line]
    assert failed and "sweep create failed" in failed[0], lines
    assert not list(tmp_path.glob("agent-*.log"))  # it stopped before starting agents


@pytest.mark.timeout(180)
def test_the_single_run_demo_is_still_there(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "preemptible",
            "demo",
            "--single",
            "--steps",
            "40",
            "--seed",
            "3",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "identical, bit for bit" in done.stdout
