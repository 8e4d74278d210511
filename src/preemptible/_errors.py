"""The one exception tree of preemptible.

    PreemptibleError              everything this library raises on purpose
    ├── ConfigError (ValueError)  a bad argument or environment value; lists what is valid
    └── CheckpointError           a checkpoint problem; the message names the path
        ├── CheckpointSaveError   writing or committing failed; older ones are untouched
        ├── CheckpointLoadError   checkpoints exist but none of them loads (or does not fit)
        └── CheckpointLockError   another writer holds the checkpoint directory

Lower-level errors (OSError, pickle and torch errors) are mapped once, where they happen,
with ``raise ... from exc`` so the original cause stays visible.
"""

from __future__ import annotations

from pathlib import Path


class PreemptibleError(Exception):
    """Base class of every error preemptible raises on purpose."""


class ConfigError(PreemptibleError, ValueError):
    """An argument or environment variable has a value preemptible cannot use."""


class CheckpointError(PreemptibleError):
    """A checkpoint could not be written or read."""

    def __init__(self, message: str, path: Path | str | None = None) -> None:
        super().__init__(message)
        self.path = Path(path) if path is not None else None


class CheckpointSaveError(CheckpointError):
    """Writing or committing a checkpoint failed; committed checkpoints are left as they were."""


class CheckpointLoadError(CheckpointError):
    """Committed checkpoints exist, but none of them could be loaded."""


class CheckpointLockError(CheckpointError):
    """Another handler or process already writes checkpoints to this directory."""
