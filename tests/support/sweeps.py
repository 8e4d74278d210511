"""The sweep commands, as the tests run them: real ``preemptible`` processes."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from tests.conftest import Child


def cli(*args: str) -> list[str]:
    """The argument list of ``preemptible ARGS`` with this interpreter."""
    return [sys.executable, "-m", "preemptible", *args]


def create(spawn: Callable[..., Child], tmp_path: Path, db: str, spec: Path) -> str:
    """``preemptible sweep create SPEC --db DB``; the new sweep's id."""
    child = spawn(cli("sweep", "create", str(spec), "--db", db), cwd=tmp_path)
    assert child.wait(60) == 0, child.output
    return child.lines[-1].strip()
