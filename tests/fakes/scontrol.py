"""A fake ``scontrol`` on PATH: answers from files, fails, or hangs like a stuck slurmctld."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

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
    ) -> None:
        (self.dir / "config").write_text(
            "Configuration data as of 2026-11-30T10:00:00\n"
            f"KillWait                = {kill_wait} sec\n"
            "MessageTimeout          = 10 sec\n"
        )
        job = (
            f"JobId=12 JobName=train JobState={state} Requeue=1 Restarts=0 "
            f"TimeLimit={'01:00:00' if end else 'UNLIMITED'} "
            f"EndTime={slurm_time(end) if end else 'Unknown'} "
            f"PreemptTime={slurm_time(preempt) if preempt else 'None'} Partition={partition}\n"
        )
        (self.dir / "job").write_text(job)
        (self.dir / "partition").write_text(
            f"PartitionName={partition} GraceTime={grace_time} PreemptMode={preempt_mode}\n"
        )

    @property
    def calls(self) -> list[str]:
        path = self.dir / "calls"
        return path.read_text().splitlines() if path.exists() else []

    def env(self) -> dict[str, str]:
        return {"PATH": f"{self.dir}{os.pathsep}{os.environ.get('PATH', '')}"}
