"""What an agent makes and reads around one attempt of a run: its directories (made, and
removed again when the attempt never started), its parameters for the log, and its ending
where the queue's is not the supervisor's (``ending.json``)."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from ..._files import write_text_atomic
from ..._text import printable

logger = logging.getLogger("preemptible")


def _mkdirs(directory: Path) -> list[Path]:
    """Make ``directory`` and its missing parents; the ones made, deepest first."""
    missing = []
    for d in (directory, *directory.parents):
        if d.exists():
            break
        missing.append(d)
    directory.mkdir(parents=True, exist_ok=True)
    return missing


def _remove(paths: list[Path]) -> None:
    """Remove what the agent made for an attempt that never started (files, empty dirs)."""
    for path in paths:
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink()


def _describe(params: dict[str, Any]) -> str:
    """The parameters for the log, one line, with control characters escaped."""
    text = " ".join(f"{k}={v}" for k, v in sorted(params.items())) or "(no parameters)"
    return printable(text)


def _write_ending(path: Path, ending: str) -> None:
    """Write the queue's ``ending`` of an attempt where it is not the supervisor's (an
    early-terminated run exits as preempted: STOPPED), for ``preemptible runs``."""
    text = json.dumps({"ending": ending}) + "\n"
    try:
        write_text_atomic(path, text)
    except OSError as exc:  # the queue has it; only the local view is the poorer
        logger.warning("preemptible: could not write %s: %s", path, exc)
