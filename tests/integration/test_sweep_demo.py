"""``preemptible demo`` (the sweep): run for real in a temporary directory, its story checked
line by line and its outcome read back from the queue it used."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from preemptible._sweep_demo import SIGTERM_RUN, STOP_FILE_RUN, run_sweep_demo
from preemptible.sweeps._store import open_store


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


@pytest.mark.timeout(300)
def test_the_demo_preempts_two_runs_and_each_resumes_bit_for_bit(tmp_path: Path) -> None:
    lines: list[str] = []
    code = run_sweep_demo(tmp_path, seed=5, echo=lines.append)
    out = "\n".join(lines)
    assert code == 0, out
    sweep = re.search(r"^  1\. sweep (\w+) created", out, re.MULTILINE)
    assert sweep, out
    sweep_id = sweep.group(1)
    assert f"live web page: preemptible status {sweep_id} --db sqlite:///" in out
    assert re.search(
        rf"SIGTERM to agent 1 during step \d+ of run {sweep_id}-{SIGTERM_RUN}: agent exit 143, "
        "run PREEMPTED at step \\d+, back in the queue",
        out,
    ), out
    assert re.search(
        rf"stop file touched during step \d+ of run {sweep_id}-{STOP_FILE_RUN} \(agent [23]\): "
        "run PREEMPTED at step \\d+, back in the queue",
        out,
    ), out
    verdicts = [line for line in lines if "the same run uninterrupted" in line]
    assert len(verdicts) == 2, out
    assert all("identical, bit for bit" in line for line in verdicts), out
    assert "DIFFERENT" not in out and "FAILED" not in out
    png = tmp_path / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"timeline of the attempts: {png}" in out

    with open_store(f"sqlite:///{tmp_path}/queue.db") as store:
        runs = store.runs(sweep_id)
        attempts = {run.index: store.attempts(run.id) for run in runs}
    assert [run.state for run in runs] == ["FINISHED"] * 6
    for index, tries in attempts.items():
        preempted = index in (SIGTERM_RUN, STOP_FILE_RUN)
        endings = ["PREEMPTED", "FINISHED"] if preempted else ["FINISHED"]
        assert [a.ending for a in tries] == endings, (index, tries)
    stopped, resumed = attempts[SIGTERM_RUN]
    assert stopped.exit_code == 143 and resumed.agent != stopped.agent
    assert attempts[STOP_FILE_RUN][0].exit_code == 143  # a notice's code
    assert not list(tmp_path.glob("stop-agent-*"))  # taken by the run, or removed
    assert not _processes_mentioning(sweep_id), "agents left running"


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
