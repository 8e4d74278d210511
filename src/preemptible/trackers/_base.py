from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from .._errors import ConfigError

logger = logging.getLogger("preemptible")

Status = Literal["finished", "failed", "preempted", "killed"]
STATUSES: tuple[Status, ...] = ("finished", "failed", "preempted", "killed")


@runtime_checkable
class Tracker(Protocol):
    def upload_checkpoint(self, path: Path) -> None: ...

    def mark_preempting(self) -> None: ...

    def finalize(self, status: Status) -> None: ...


class BaseTracker:
    """Validates statuses and finalizes at most once; adapters implement the ``_`` methods."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.finalized: Status | None = None

    def upload_checkpoint(self, path: Path) -> None:
        self._upload(Path(path))

    def mark_preempting(self) -> None:
        self._mark_preempting()

    def finalize(self, status: Status) -> None:
        if status not in STATUSES:
            raise ConfigError(f"status {status!r} is not valid; use one of {', '.join(STATUSES)}")
        with self._lock:
            if self.finalized is not None:
                logger.debug(
                    "preemptible: tracker already finalized as %s; ignoring %s",
                    self.finalized,
                    status,
                )
                return
            self.finalized = status
        self._finalize(status)

    def _upload(self, path: Path) -> None:
        raise NotImplementedError

    def _mark_preempting(self) -> None:
        raise NotImplementedError

    def _finalize(self, status: Status) -> None:
        raise NotImplementedError


class TrackerGroup(BaseTracker):
    """Several trackers told the same story (a Hugging Face run that reports to MLflow and
    W&B at once). ``upload=False``: checkpoints stay where they were committed (the run's
    trackers were set up by the framework, which uploads what it was asked to). One tracker
    that fails does not keep the others from being told."""

    def __init__(self, trackers: list[Tracker], *, upload: bool = True) -> None:
        super().__init__()
        self.trackers = list(trackers)
        self.upload = upload

    def _each(self, what: str, call: str, *args: object) -> None:
        for tracker in self.trackers:
            try:
                getattr(tracker, call)(*args)
            except Exception as exc:
                logger.error(
                    "preemptible: %s %s failed: %s: %s",
                    type(tracker).__name__,
                    what,
                    type(exc).__name__,
                    exc,
                )

    def _upload(self, path: Path) -> None:
        if self.upload:
            self._each("upload", "upload_checkpoint", path)

    def _mark_preempting(self) -> None:
        self._each("mark_preempting", "mark_preempting")

    def _finalize(self, status: Status) -> None:
        self._each("finalize", "finalize", status)
