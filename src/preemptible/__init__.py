"""preemptible: training runs that survive being stopped.

On the first signal or platform notice the current step finishes, a checkpoint is committed
atomically and the process exits with a code schedulers understand; the next run resumes bit
for bit. ``import preemptible`` imports no torch or other heavy library.
"""

from __future__ import annotations

from ._errors import (
    AgreementError,
    CheckpointError,
    CheckpointLoadError,
    CheckpointLockError,
    CheckpointRemoteError,
    CheckpointSaveError,
    ConfigError,
    DatabaseGone,
    LeaseLost,
    NoticeError,
    PreemptibleError,
    RunLockedError,
    SlurmError,
    SlurmUnreachable,
    StoreError,
    UnreadableField,
)
from ._handler import PreemptionCheckpointHandler
from ._report import report
from ._run import RunInfo, current_run, mark_preempting
from .checkpoint._store import Checkpoint, CheckpointStore
from .notices import detect_platform
from .stop._termination import Notice, TerminationConfig

__version__ = "0.1.0"

__all__ = [
    "AgreementError",
    "Checkpoint",
    "CheckpointError",
    "CheckpointLoadError",
    "CheckpointLockError",
    "CheckpointRemoteError",
    "CheckpointSaveError",
    "CheckpointStore",
    "ConfigError",
    "DatabaseGone",
    "LeaseLost",
    "Notice",
    "NoticeError",
    "PreemptibleError",
    "PreemptionCheckpointHandler",
    "RunInfo",
    "RunLockedError",
    "SlurmError",
    "SlurmUnreachable",
    "StoreError",
    "TerminationConfig",
    "UnreadableField",
    "__version__",
    "current_run",
    "detect_platform",
    "mark_preempting",
    "report",
]
