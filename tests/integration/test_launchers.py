"""Launchers that do not pass a stop signal on (``stop/_launcher.py``), with the real
``accelerate launch``: without ``--multi_gpu`` (its simple launcher, ``--cpu --num_processes 2``
included) it ends on SIGTERM and leaves the trainer running, so a program it started says so
at start; under ``preemptible run`` nothing is said, and a SIGTERM to the supervisor reaches
the trainer, which commits its checkpoint. What the program and the doctor say is tested
under a stand-in that does what the simple launcher does (``Popen``, ``wait``), at the cost of
one torch import instead of two."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PY, attempts, python_args, supervise

pytest.importorskip("accelerate")

pytestmark = pytest.mark.timeout(180)

ACCELERATE = [str(Path(sys.executable).with_name("accelerate")), "launch", "--cpu"]
SIMPLE = [*ACCELERATE, "--num_processes", "2"]  # --cpu: the simple launcher, one process
WARNING = "preemptible: started by accelerate launch (pid "


# a stand-in named accelerate that does what accelerate's simple launcher does: Popen, wait
SIMPLE_LAUNCHER = f"""#!{sys.executable}
import subprocess, sys
sys.exit(subprocess.Popen(sys.argv[2:]).wait())
"""


def stand_in(tmp_path: Path) -> str:
    launcher = tmp_path / "bin" / "accelerate"
    launcher.parent.mkdir(exist_ok=True)
    launcher.write_text(SIMPLE_LAUNCHER)
    launcher.chmod(0o755)
    return str(launcher)


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTIBLE_", "TORCHELASTIC_"))
    }
    return {**env, **extra}


def doctor_under(tmp_path: Path, **env: str) -> dict[str, str]:
    out = subprocess.run(
        [stand_in(tmp_path), "launch", PY, "-m", "preemptible", "doctor", "--json"],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=50,
    )
    [check] = [c for c in json.loads(out.stdout) if c["name"] == "launcher"]
    return check


def test_doctor_warns_under_a_simple_launcher_and_not_under_torchs_agent_or_preemptible_run(
    tmp_path: Path,
) -> None:
    check = doctor_under(tmp_path)
    assert check["status"] == "warn", check
    assert check["detail"].startswith("started by accelerate launch (pid "), check
    assert "preemptible run -- " in check["fix"], check
    # a worker of torch's elastic agent (accelerate launch --multi_gpu, torchrun): it forwards
    assert doctor_under(tmp_path, TORCHELASTIC_RUN_ID="none")["status"] == "info"
    under_run = doctor_under(tmp_path, PREEMPTIBLE_RUN_ID="r")
    assert under_run["status"] == "ok" and "whole process group" in under_run["detail"]


def test_a_program_under_a_simple_launcher_says_so_once_at_start(tmp_path: Path, spawn) -> None:
    train = python_args("train.py", "--ckpt", "ckpt", "--out", "w.pt", "--steps", "2")
    job = spawn([stand_in(tmp_path), "launch", *train], cwd=tmp_path, env=clean_env())
    assert job.wait(120) == 0, job.output
    said = [line for line in job.lines if WARNING in line]
    assert len(said) == 1, job.output
    assert "its simple launcher" in said[0] and "`preemptible run -- ...`" in said[0]


def test_under_preemptible_run_accelerates_simple_launcher_stops_with_a_checkpoint(
    tmp_path: Path, spawn
) -> None:
    train = python_args("train.py", "--ckpt", "ckpt", "--out", "w.pt", "--step-sleep", "0.2")
    job = [*SIMPLE, *train[1:]]
    sup = supervise(spawn, tmp_path, "--max-preemptions", "0", "--", *job)
    sup.wait_line(lambda line: line == "step 3", timeout=120)
    assert not any(WARNING in line for line in sup.lines), sup.output
    # the supervisor's own SIGTERM, as a platform sends it: passed on to the job's group
    sup.signal(signal.SIGTERM)
    assert sup.wait(120) == 143, sup.output
    [first] = attempts(tmp_path)
    assert first["state"] == "PREEMPTED", first
    assert any("stopped at step" in line for line in sup.lines), sup.output
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*.ckpt")), sup.output
