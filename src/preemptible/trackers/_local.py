from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ._base import BaseTracker, Status


class LocalTracker(BaseTracker):
    """Appends one JSON object per event to ``path``: upload, preempting, finalize."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _write(self, **event: Any) -> None:
        event["time"] = time.time()
        with open(self.path, "a") as fh:
            fh.write(json.dumps(event) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _upload(self, path: Path) -> None:
        self._write(event="checkpoint", path=str(path.resolve()))

    def _mark_preempting(self) -> None:
        self._write(event="preempting")

    def _finalize(self, status: Status) -> None:
        self._write(event="finalize", status=status)

    def events(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]
