"""``preemptible doctor`` in real subprocesses: what it says, and that it never hangs or crashes.

A fake ``scontrol`` first on PATH answers, fails or hangs; signal dispositions and the blocked
mask are set in the child before it execs, as a shell (``nohup``, ``trap``) would leave them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from preemptible.doctor._doctor import WARN, _run
from tests.support.env import CLEAN
from tests.support.slurm import FakeScontrol

pytestmark = pytest.mark.timeout(60)


def doctor(
    env: dict[str, str], preexec: Callable[[], None] | None = None, timeout: float = 30
) -> tuple[dict[str, dict[str, str]], subprocess.CompletedProcess[str]]:
    out = subprocess.run(
        [sys.executable, "-m", "preemptible", "doctor", "--json"],
        env={**os.environ, **CLEAN, "PREEMPTIBLE_DMI_DIR": "/nonexistent", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec,
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    return {c["name"]: c for c in json.loads(out.stdout)}, out


@pytest.fixture
def fake(tmp_path: Path) -> FakeScontrol:
    return FakeScontrol(tmp_path / "bin")


def in_job(fake: FakeScontrol, **env: str) -> dict[str, str]:
    return {**fake.env(), "SLURM_JOB_ID": "12", **env}


def test_hung_scontrol_neither_hangs_nor_crashes(fake: FakeScontrol) -> None:
    fake.mode("hang")
    started = time.monotonic()
    checks, _ = doctor(in_job(fake))
    assert time.monotonic() - started < 15, "one timeout, then no more waiting"
    assert fake.calls == ["show job -o 12"], "after one timeout scontrol is not asked again"
    assert checks["slurm"]["status"] == WARN
    assert "scontrol show job -o 12 did not answer within 3 s" in checks["slurm"]["detail"]
    assert checks["notices (slurm)"]["status"] == WARN
    assert checks["term-timeout"]["status"] == WARN
    assert "SLURM's kill deadline is unknown" in checks["term-timeout"]["detail"]
    sleeper = int((fake.dir / "sleep.pid").read_text())
    stat = Path(f"/proc/{sleeper}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.parametrize("broken", ["fail", "missing"])
def test_failing_or_missing_scontrol_is_a_warn_line(broken: str, fake: FakeScontrol) -> None:
    env = in_job(fake)
    if broken == "fail":
        fake.mode("fail")
        why = "scontrol show job -o 12 failed (exit 1): slurm_load_jobs error"
    else:
        env["PATH"] = str(fake.dir / "empty")
        why = "scontrol is not on PATH"
    checks, _ = doctor(env)
    for name in ("slurm", "notices (slurm)", "term-timeout"):
        assert checks[name]["status"] == WARN, checks[name]
    assert why in checks["slurm"]["detail"]


def test_term_timeout_shows_slurms_killwait_and_gracetime(fake: FakeScontrol) -> None:
    fake.answer(kill_wait=30, end=time.time() + 3600, grace_time=120, preempt_mode="REQUEUE")
    checks, _ = doctor(in_job(fake))
    c = checks["term-timeout"]
    assert c["status"] == "ok", c
    assert (
        "SLURM SIGKILLs every process of the job KillWait=30 s after its own SIGTERM"
        in (c["detail"])
    )
    assert "partition gpu: PreemptMode=REQUEUE, GraceTime=120 s" in c["detail"]
    assert "escalates to SIGKILL 28 s after that SIGTERM" in c["detail"]
    assert "60 s after the first stop signal (the default" in c["detail"]


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        (
            {"PREEMPTIBLE_TERM_TIMEOUT": "60"},
            "PREEMPTIBLE_TERM_TIMEOUT=60 s is longer than KillWait",
        ),
        (
            {"PREEMPTIBLE_GRACE_PERIOD": "45"},
            "PREEMPTIBLE_GRACE_PERIOD=45 s is longer than KillWait",
        ),
        ({"PREEMPTIBLE_GRACE_PERIOD": "soon"}, "PREEMPTIBLE_GRACE_PERIOD='soon' is not valid"),
        ({"PREEMPTIBLE_TERM_TIMEOUT": "-1"}, "PREEMPTIBLE_TERM_TIMEOUT='-1' is not valid"),
    ],
)
def test_term_timeout_warns_when_slurm_kills_first(
    env: dict[str, str], problem: str, fake: FakeScontrol
) -> None:
    fake.answer(kill_wait=30, end=time.time() + 3600)
    checks, _ = doctor(in_job(fake, **env))
    assert checks["term-timeout"]["status"] == WARN
    assert checks["term-timeout"]["detail"].startswith(problem), checks["term-timeout"]


def test_kubernetes_without_a_grace_period_kills_before_the_default() -> None:
    checks, _ = doctor({"KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    c = checks["term-timeout"]
    assert c["status"] == WARN
    assert "Kubernetes SIGKILLs the pod 30 s after SIGTERM (assumed" in c["detail"]
    assert "PREEMPTIBLE_GRACE_PERIOD" in c["fix"]
    checks, _ = doctor({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "PREEMPTIBLE_GRACE_PERIOD": "20"})
    assert checks["term-timeout"]["status"] == "ok"
    assert "18 s after the first stop signal" in checks["term-timeout"]["detail"]


def test_bad_job_ids_and_requeue_mode_are_warn_lines(fake: FakeScontrol) -> None:
    fake.answer()
    checks, _ = doctor({**fake.env(), "SLURM_JOB_ID": "/../../x"})
    assert checks["slurm"]["status"] == WARN
    assert "SLURM_JOB_ID='/../../x' is not valid" in checks["slurm"]["detail"]
    assert checks["term-timeout"]["status"] == WARN
    assert fake.calls == []
    checks, _ = doctor(in_job(fake, PREEMPTIBLE_REQUEUE="always"))
    assert checks["slurm requeue"]["status"] == WARN
    assert (
        "PREEMPTIBLE_REQUEUE='always' is not valid; use one of auto, never"
        in (checks["slurm requeue"]["detail"])
    )


def test_default_signals_are_ok() -> None:
    checks, _ = doctor({})
    assert checks["signals"]["status"] == "ok"
    assert checks["signals"]["detail"].startswith("INT, TERM, HUP, USR1, USR2:")
    assert not [name for name in checks if name.startswith("signal ")]


def ignore(*sigs: signal.Signals) -> Callable[[], None]:
    def preexec() -> None:
        for sig in sigs:
            signal.signal(sig, signal.SIG_IGN)

    return preexec


def test_nohup_hup_is_info() -> None:
    checks, _ = doctor({}, ignore(signal.SIGHUP))
    assert checks["signal HUP"] == {
        "name": "signal HUP",
        "status": "info",
        "detail": "HUP ignored (nohup): a hang-up will not stop the run",
        "fix": "",
    }
    assert checks["signals"]["detail"].startswith("INT, TERM, USR1, USR2:")


def test_ignored_term_and_int_are_warnings() -> None:
    checks, _ = doctor({}, ignore(signal.SIGTERM, signal.SIGINT))
    term, sigint = checks["signal TERM"], checks["signal INT"]
    assert term["status"] == WARN and sigint["status"] == WARN
    assert "preemptible installs its handler over it, so TERM still stops a run" in term["detail"]
    assert "preemptible keeps it ignored, so INT (Ctrl+C) will not stop the run" in sigint["detail"]
    assert checks["signals"]["detail"].startswith("HUP, USR1, USR2:")


def test_blocked_signal_is_a_warning() -> None:
    checks, _ = doctor({}, lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2}))
    c = checks["signal USR2"]
    assert c["status"] == WARN
    assert "USR2 is blocked in this process (inherited signal mask)" in c["detail"]


def test_a_check_that_breaks_is_a_warn_line() -> None:
    def broken() -> None:
        raise RuntimeError("boom")

    [c] = _run("pid 1", broken)
    assert (c.name, c.status) == ("pid 1", WARN)
    assert c.detail == "this check failed: RuntimeError: boom"


def test_human_output_has_no_traceback(fake: FakeScontrol) -> None:
    fake.mode("hang")
    out = subprocess.run(
        [sys.executable, "-m", "preemptible", "doctor"],
        env={**os.environ, **CLEAN, **in_job(fake), "PREEMPTIBLE_GRACE_PERIOD": "x"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and "Traceback" not in out.stdout + out.stderr
    assert "WARN slurm " in out.stdout and "WARN term-timeout" in out.stdout


def test_containment_says_which_and_why() -> None:
    from preemptible.supervisor._cgroup import probe

    here = probe()
    checks, _ = doctor({})
    c = checks["containment"]
    assert c["status"] == "ok", c
    if here.kind == "cgroup":
        want = "cgroup v2: each attempt of preemptible run gets a cgroup of its own under "
        assert c["detail"].startswith(f"{want}{here.parent};")
    else:
        assert c["detail"].startswith(f"/proc guardian ({here.why}). A guardian tracks")
        assert "systemd-run --user --scope -p Delegate=yes" in c["fix"]
    checks, _ = doctor({"PREEMPTIBLE_CONTAINMENT": "proc"})
    assert checks["containment"]["detail"].startswith(
        "/proc guardian (PREEMPTIBLE_CONTAINMENT=proc). A guardian tracks"
    )
    checks, _ = doctor({"PREEMPTIBLE_CONTAINMENT": "cgroup"})
    assert checks["containment"]["status"] == ("ok" if here.kind == "cgroup" else WARN)
    checks, _ = doctor({"PREEMPTIBLE_CONTAINMENT": "docker"})
    assert checks["containment"] == {
        "name": "containment",
        "status": WARN,
        "detail": "PREEMPTIBLE_CONTAINMENT='docker' is not valid; use one of auto, cgroup, proc",
        "fix": "set PREEMPTIBLE_CONTAINMENT=auto (or unset it)",
    }
