"""The files a supervisor writes for others to read: the attempts journal, the heartbeat and
the ``--pid-file``. Each is best effort: one that cannot be written costs one warning, never
the run."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from .._files import write_text_atomic
from .._paths import RunPaths
from . import _journal
from ._journal import Attempt

logger = logging.getLogger("preemptible")


class RunFiles:
    def __init__(self, paths: RunPaths, run_id: str, pid_file: Path | None) -> None:
        self.paths = paths
        self.run_id = run_id
        self.pid_file = pid_file
        self._pid_text: str | None = None
        self._warned: set[str] = set()

    def warn_once(self, what: str, path: Path, exc: OSError) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(
                "preemptible: cannot write %s (%s); the run goes on without it",
                path,
                exc.strerror or exc,
            )

    def journal(self, attempt: Attempt) -> None:
        try:
            _journal.append(self.paths.journal, attempt)
        except OSError as exc:
            self.warn_once("journal", self.paths.journal, exc)

    def heartbeat(self, **fields: Any) -> None:
        path = self.paths.heartbeat
        beat = {**fields, "pid": os.getpid(), "run_id": self.run_id, "at": time.time()}
        try:
            write_text_atomic(path, json.dumps(beat))
        except OSError as exc:
            self.warn_once("heartbeat", path, exc)

    def check_pid_file(self) -> None:
        """Fail before the job starts, not when its pid is to be written."""
        path = self.pid_file
        if path is None:
            return
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            os.unlink(tmp)
        except OSError as exc:
            raise ConfigError(
                f"--pid-file {path}: cannot write in {path.parent} ({exc.strerror or exc}); "
                "give a file in an existing, writable directory"
            ) from exc

    def write_pid(self, pid: int) -> None:
        path = self.pid_file
        if path is None:
            return
        text = f"{pid}\n"
        try:
            write_text_atomic(path, text)
            self._pid_text = text
        except OSError as exc:
            self.warn_once("pid file", path, exc)

    def remove_pid(self) -> None:
        """Only while it still holds our pid: another process may have taken the name."""
        path = self.pid_file
        if path is None or self._pid_text is None:
            return
        with contextlib.suppress(OSError, ValueError):
            if path.read_text() == self._pid_text:
                path.unlink()
