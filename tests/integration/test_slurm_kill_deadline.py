"""``preemptible run`` escalates before SLURM's own SIGKILL, and refuses crafted job ids.

SLURM SIGKILLs every process of a job KillWait after its SIGTERM (plain scancel, time limit,
preemption), whatever --term-timeout says; a supervisor killed first records nothing. The
first tests use a fake scontrol; the last ones run in the real single-node SLURM
(tests/services/slurm.sh) and skip when it is not up.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import PY, attempts, supervise, wait_for
from tests.support.slurm import FakeScontrol, job_field, kill_wait

STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(1000)"
)


@pytest.mark.timeout(60)
def test_escalation_comes_before_slurms_kill(tmp_path: Path, spawn) -> None:
    fake = FakeScontrol(tmp_path / "bin")
    fake.answer(kill_wait=5, state="COMPLETING", end=time.time())  # as after a plain scancel
    env = {**fake.env(), "SLURM_JOB_ID": "12", "PREEMPTIBLE_REQUEUE": "never"}
    sup = supervise(spawn, tmp_path, "--", PY, "-c", STUBBORN, env=env)
    sup.wait_line(
        lambda line: line.startswith("up"), timeout=30
    )  # a log line may land before its "\n"
    sent = time.monotonic()
    sup.signal(signal.SIGTERM)
    assert sup.wait(30) == 143, sup.output  # PREEMPTED: its own SIGKILL after the stop
    assert 2.9 < time.monotonic() - sent < 4.5, sup.output
    assert (
        "SIGKILL in 3 s if it has not exited (2 s before SLURM's own SIGKILL: KillWait=5 s, "
        "job COMPLETING)" in sup.output
    )
    [a] = attempts(tmp_path)
    assert a["ending"] == "killed by SIGKILL"
    assert (tmp_path / ".preemptible" / "runs" / "slurm-12").is_dir()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "env",
    [
        {"SLURM_JOB_ID": "/../../../escaped"},
        {
            "SLURM_JOB_ID": "7",
            "SLURM_ARRAY_JOB_ID": "7",
            "SLURM_ARRAY_TASK_ID": "/../../../escaped",
        },
    ],
)
def test_a_crafted_job_id_is_refused(env: dict[str, str], tmp_path: Path, spawn) -> None:
    home = tmp_path / "h" / "home"
    sup = spawn(
        [PY, "-m", "preemptible", "run", "--home", str(home), "--", "true"],
        cwd=tmp_path,
        env={"PATH": str(Path(PY).parent), **env},
    )
    assert sup.wait(30) == 2, sup.output
    name = next(iter(k for k, v in env.items() if "escaped" in v))
    assert sup.output == (
        f"preemptible: {name}='/../../../escaped' is not valid; SLURM job ids are digits, "
        "e.g. 12345"
    )
    assert not list(tmp_path.rglob("escaped"))


# --- the real SLURM ------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_plain_scancel_the_supervisor_escalates_and_records_first(sbatch, tmp_path: Path) -> None:
    wait = kill_wait()
    script = tmp_path / "job.sh"
    script.write_text(
        f'#!/bin/bash\ncd {tmp_path}\nexec {PY} -m preemptible run -- {PY} -c "{STUBBORN}"\n'
    )
    out = tmp_path / "job.out"
    job = sbatch("-o", str(out), str(script))
    wait_for(lambda: out.exists() and "up\n" in out.read_text(), 60, "the trainer to start")
    subprocess.run(["scancel", job], check=True, timeout=30)
    wait_for(lambda: job_field(job, "JobState") == "CANCELLED", 60, "the job to end")
    text = out.read_text()
    escalate = max(wait - 2, wait / 2)
    assert f"SIGKILL in {escalate:.0f} s if it has not exited (2 s before SLURM's own " in text
    assert f"KillWait={wait} s, job " in text
    assert "sending SIGKILL to all of its processes" in text, text
    run = tmp_path / ".preemptible" / "runs" / f"slurm-{job}"
    [a] = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()]
    assert a["ending"] == "killed by SIGKILL" and a["signals"] == ["SIGTERM"]


@pytest.mark.timeout(120)
def test_doctor_in_a_real_job_shows_slurms_deadline(sbatch, tmp_path: Path) -> None:
    wait = kill_wait()
    doctor = f"{sys.executable} -m preemptible doctor --json"
    job = sbatch(
        "--time=30",
        "-o",
        "/dev/null",
        "--wrap",
        f"{doctor} > {tmp_path}/a.json && "
        f"PREEMPTIBLE_TERM_TIMEOUT=600 {doctor} > {tmp_path}/b.json",
    )
    wait_for(lambda: job_field(job, "JobState") == "COMPLETED", 60, "the doctor job")
    a = {c["name"]: c for c in json.loads((tmp_path / "a.json").read_text())}
    b = {c["name"]: c for c in json.loads((tmp_path / "b.json").read_text())}
    detail = a["term-timeout"]["detail"]
    assert a["term-timeout"]["status"] == "ok", detail
    assert f"KillWait={wait} s after its own SIGTERM" in detail
    assert "partition debug: PreemptMode=" in detail and "GraceTime=" in detail
    assert f"escalates to SIGKILL {max(wait - 2, wait / 2):g} s after that SIGTERM" in detail
    assert b["term-timeout"]["status"] == "warn"
    assert "PREEMPTIBLE_TERM_TIMEOUT=600 s is longer than KillWait" in b["term-timeout"]["detail"]
