"""The one exception tree of preemptible.

    PreemptibleError               everything this library raises on purpose
    ├── ConfigError (ValueError)   a bad argument, environment value or spec; lists what is valid
    │   └── UnreadableField        a JSON field of the sweep queue cannot be read back
    ├── CheckpointError            a checkpoint problem; the message names the path
    │   ├── CheckpointSaveError    writing or committing failed; older ones are untouched
    │   ├── CheckpointLoadError    checkpoints exist but none of them loads (or does not fit)
    │   ├── CheckpointLockError    another writer holds the checkpoint directory
    │   └── CheckpointRemoteError  a checkpoint URL's bucket is missing, unreachable or refuses us
    ├── AgreementError             the ranks could not agree on the stop (timeout, a rank ahead)
    ├── NoticeError (ValueError)   a platform notice source answered what it cannot understand
    ├── RunLockedError             another live supervisor holds the run (its supervisor.lock)
    ├── SlurmError                 scontrol is missing, failed, or did not answer in time
    │   └── SlurmUnreachable       scontrol is missing or timed out: asking again soon waits again
    ├── StoreError                 the sweep database refused an operation or stayed unreachable
    │   └── DatabaseGone           the SQLite file was deleted or replaced: every agent stops
    └── LeaseLost                  this agent no longer holds the run: its lease expired

Lower-level errors (OSError, pickle and torch errors, the database drivers' errors) are mapped
once, where they happen, with ``raise ... from exc`` so the original cause stays visible (or
``from None`` where the cause would quote a secret, such as a database URL's password).
"""

from __future__ import annotations

from pathlib import Path


class PreemptibleError(Exception):
    """Base class of every error preemptible raises on purpose."""


class ConfigError(PreemptibleError, ValueError):
    """An argument or environment variable has a value preemptible cannot use."""


class UnreadableField(ConfigError):
    """A JSON column of the queue holds something that cannot be read back."""


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


class CheckpointRemoteError(CheckpointError):
    """A checkpoint URL's bucket or container cannot be used: it does not exist, the credentials
    of the cloud's standard chain are missing or refused, or it cannot be reached in time.

    ``reason``: ``"missing"`` (no such bucket or container), ``"refused"`` (the credentials
    refused), or ``""`` (anything else, which may pass by itself: unreachable, no credentials
    from a metadata server yet)."""

    reason: str = ""


class AgreementError(PreemptibleError):
    """The ranks could not agree (one did not answer in time, or one passed the agreed step)."""


class NoticeError(PreemptibleError, ValueError):
    """A metadata server (or a stop or lease file) answered something a notice source does not
    understand. A watcher logs it once and polls on; it never stops training."""


class RunLockedError(PreemptibleError):
    """Another live supervisor holds the run (its ``supervisor.lock``)."""


class SlurmError(PreemptibleError):
    """scontrol is missing, failed, or did not answer in time."""


class SlurmUnreachable(SlurmError):
    """scontrol is missing or did not answer: asking again soon would only wait again."""


class StoreError(PreemptibleError):
    """The sweep database refused an operation, or stayed unreachable past the retry deadline."""


class DatabaseGone(StoreError):
    """The SQLite file this process opened was deleted or replaced by another file: nothing
    is recreated, and every process using it stops instead of splitting the queue."""


class LeaseLost(PreemptibleError):
    """This agent no longer holds the run: its lease expired and the run was requeued."""
