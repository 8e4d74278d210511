"""A sweep database whose disk fills up while an agent runs a run: the agent says so once,
keeps the run and waits, and goes on when space comes back; the run ends FINISHED.

The disk is real: a small tmpfs mounted for the test (root only; elsewhere it skips and says
why), filled with a file until the kernel answers ENOSPC, emptied by removing that file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from preemptible.sweeps.store._queue import open_store
from tests.conftest import Child
from tests.support.sweeps import cli, create

pytestmark = pytest.mark.timeout(120)

# runs until the test says "go" (a file appears), then exits 0
PROGRAM = """
import os, sys, time
print("program started", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def fill(directory: Path) -> Path:
    """A file that takes every free byte of ``directory``'s file system."""
    path = directory / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 16, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * chunk)
        with pytest.raises(OSError) as info:
            os.write(fd, b"\0")
        assert info.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return path


def test_a_full_database_disk_is_waited_out_with_the_run(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        db = f"sqlite:///{disk / 'q.db'}"
        program = tmp_path / "wait_for_go.py"
        program.write_text(PROGRAM)
        go = tmp_path / "go"
        spec = tmp_path / "s.yaml"
        spec.write_text(
            json.dumps(
                {
                    "program": str(program),
                    "command": ["${interpreter}", "${program}", str(go)],
                    "method": "grid",
                    "parameters": {"a": {"value": 1}},
                }
            )
        )
        sweep = create(spawn, tmp_path, db, spec)
        agent = spawn(
            cli("agent", sweep, "--db", db, "--count", "1", "--heartbeat", "0.5"), cwd=tmp_path
        )
        agent.wait_line(lambda line: line == "program started", 60)
        filler = fill(disk)  # the next renewal of the run's lease finds no space
        said = agent.wait_line(lambda line: "is out of space" in line and "retrying" in line, 30)
        assert "(database or disk is full)" in said and "free some space where" in said, said
        assert agent.proc.poll() is None, agent.output  # it waits, with the run
        with open_store(db, reader=True, retry_timeout=10) as store:
            [run] = store.runs(sweep)
        assert run.state == "RUNNING"
        filler.unlink()  # space again
        agent.wait_line(lambda line: "answers again" in line, 30)
        go.touch()  # the program ends
        assert agent.wait(60) == 0, agent.output
        assert sum("out of space" in line for line in agent.lines) == 1, agent.output  # once
        with open_store(db, reader=True, retry_timeout=10) as store:
            [run] = store.runs(sweep)
        assert run.state == "FINISHED", agent.output
