"""A front end of one's own on the kit, in real processes: a checkpoint format of its own
committed by ``NamedSaver``, stopped by a real signal, resumed by ``preemptible run``."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.conftest import attempts, python_args, read_pid, supervise

pytestmark = pytest.mark.timeout(120)


def test_a_named_checkpoint_is_what_the_supervisor_resumes_from(tmp_path: Path, spawn) -> None:
    """The kit records the newest commit of any name; the supervisor's next attempt gets it as
    PREEMPTIBLE_RESUME_FROM (before, only step-N.ckpt files counted: Lightning's resume.ckpt
    never did), and the resumed run ends with the sum an uninterrupted one has."""
    ckpt = tmp_path / "ckpt"
    run = python_args("named_train.py", "--dir", str(ckpt), "--steps", "40", "--sleep", "0.05")
    pid_file = tmp_path / "job.pid"
    sup = supervise(
        spawn, tmp_path, "--max-preemptions", "1", "--pid-file", str(pid_file), "--", *run
    )
    sup.wait_line(lambda line: line == "step 10", timeout=60)
    os.kill(read_pid(pid_file), signal.SIGTERM)  # the job is preempted, not its supervisor
    assert sup.wait(90) == 0, sup.output
    first, second = attempts(tmp_path)
    assert first["state"] == "PREEMPTED" and first["exit_code"] == 143, first
    assert second["state"] == "FINISHED", second
    named = (ckpt / "model.txt").resolve()
    assert f"resume from {named}" in sup.output
    assert f"total {sum(range(40))}" in sup.output  # no step lost, none done twice
    [record] = [json.loads(p.read_text()) for p in tmp_path.rglob("attempt-2/record.json")]
    assert record["state"] == "finished" and record["resume_from"] == str(named)
    assert sorted(p.name for p in ckpt.iterdir()) == [".preemptible.lock", "model.txt"]
