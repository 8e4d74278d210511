"""SLURM for tests: a fake ``scontrol`` on PATH, and the real single-node cluster.

``FakeScontrol`` answers from files, fails, or hangs like a stuck slurmctld. The fixtures
``slurm`` (skips where no controller answers) and ``sbatch`` (submits, cancels at teardown) are
for the real cluster that tests/services/slurm.sh starts (``with-services.sh`` does it and sets
``PREEMPTIBLE_TEST_SLURM=1``; any other value of that variable is the reason to skip).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest

SCRIPT = """#!/bin/bash
here=$(dirname "$0")
echo "$*" >> "$here/calls"
case "$1 $2" in
    "show config") what=config ;;
    "show job") what=job ;;
    "show partition") what=partition ;;
    *) what=other ;;
esac
case "$(cat "$here/mode")" in
    hang) sleep 1000 & echo $! > "$here/sleep.pid"; wait; exit 0 ;;
    fail) echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1 ;;
esac
[ -f "$here/$what" ] || { echo "scontrol: no answer for $*" >&2; exit 1; }
cat "$here/$what"
"""


def slurm_time(at: float) -> str:
    return datetime.fromtimestamp(at).isoformat(timespec="seconds")


class FakeScontrol:
    """``FakeScontrol(dir)`` writes ``dir/scontrol``; put ``dir`` first on PATH."""

    def __init__(self, where: Path) -> None:
        self.dir = where
        where.mkdir(parents=True, exist_ok=True)
        exe = where / "scontrol"
        exe.write_text(SCRIPT)
        exe.chmod(0o755)
        self.mode("ok")

    def mode(self, mode: str) -> None:
        """ok | hang | fail"""
        (self.dir / "mode").write_text(mode)

    def answer(
        self,
        *,
        kill_wait: int = 5,
        state: str = "RUNNING",
        end: float | None = None,
        preempt: float | None = None,
        partition: str = "gpu",
        grace_time: int = 0,
        preempt_mode: str = "OFF",
        reason: str = "None",
    ) -> None:
        (self.dir / "config").write_text(
            "Configuration data as of 2026-11-30T10:00:00\n"
            f"KillWait                = {kill_wait} sec\n"
            "MessageTimeout          = 10 sec\n"
        )
        job = (
            f"JobId=12 JobName=train JobState={state} Reason={reason} Requeue=1 Restarts=0 "
            f"TimeLimit={'01:00:00' if end else 'UNLIMITED'} "
            f"EndTime={slurm_time(end) if end else 'Unknown'} "
            f"PreemptTime={slurm_time(preempt) if preempt else 'None'} Partition={partition}\n"
        )
        (self.dir / "job").write_text(job)
        (self.dir / "partition").write_text(
            f"PartitionName={partition} GraceTime={grace_time} PreemptMode={preempt_mode}\n"
        )
        (self.dir / "other").write_text("")  # `scontrol requeue` says nothing when it works

    @property
    def calls(self) -> list[str]:
        path = self.dir / "calls"
        return path.read_text().splitlines() if path.exists() else []

    def env(self) -> dict[str, str]:
        return {"PATH": f"{self.dir}{os.pathsep}{os.environ.get('PATH', '')}"}


# --- the real SLURM ------------------------------------------------------------------------


def slurm_unavailable() -> str | None:
    """Why the real SLURM cannot be used here, or None when its controller answers."""
    flag = os.environ.get("PREEMPTIBLE_TEST_SLURM")
    if flag and flag != "1":
        return flag
    if shutil.which("scontrol") is None:
        return (
            "SLURM is not installed; run the suite through make test, or start it with "
            "bash tests/services/slurm.sh up"
        )
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    if "is UP" not in ping.stdout:
        return "no SLURM controller answers; start one with bash tests/services/slurm.sh up"
    return None


@pytest.fixture(scope="session")
def slurm() -> None:
    """Skips the test where the real SLURM is not up (asked once per session)."""
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def sbatch(slurm: None) -> Iterator[Callable[..., str]]:
    """``sbatch(*args)`` submits a job and returns its id; every job is cancelled at teardown."""
    jobs: list[str] = []

    def submit(*args: str) -> str:
        out = subprocess.run(
            ["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=30, check=True
        )
        jobs.append(out.stdout.strip().split(";")[0])
        return jobs[-1]

    yield submit
    for job in jobs:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)


def job_field(job: str, name: str) -> str | None:
    """One field of ``scontrol show job JOB`` (``JobState``, ``Restarts``...), None if absent."""
    out = subprocess.run(
        ["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30
    ).stdout
    m = re.search(rf"\b{name}=(\S+)", out)
    return m.group(1) if m else None


def kill_wait() -> int:
    """The cluster's KillWait, in seconds."""
    out = subprocess.run(
        ["scontrol", "show", "config"], capture_output=True, text=True, timeout=30
    ).stdout
    return int(next(line for line in out.splitlines() if line.startswith("KillWait")).split()[2])
