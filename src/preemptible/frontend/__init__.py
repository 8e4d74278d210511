"""The front-end kit: what every front end of preemptible is built on.

A front end (``PreemptionCheckpointHandler``, the Lightning callback, one for a framework of
your own) tells the kit two things: *where its boundaries are* and *how to save*. It creates a
``StopSession`` with a ``Saver``, calls ``start()``, then ``at_boundary(Phase.STEP, step=...)``
after every training step (``Phase.EVALUATION`` after an evaluation batch, ``Phase.END`` when
training is over) and ``finished()`` when it ends. The session does the rest: the signal
latch and platform notices, the grace policy (insurance checkpoints, the last safe step),
periodic saves, the agreement of every rank under torch.distributed (or over the key-value
store of another framework's process group: ``StopSession(ranks=Ranks.over(store, rank,
world))``), the directory lock, the run record; a stop goes through its stop sequence
(``_sequence.py``).

Savers:

- ``StateSaver(directory, state, ...)``: a mapping of objects with ``state_dict()`` and plain
  values (or ``save_fn``) in ``step-N.ckpt``; it becomes a ``PayloadSaver``, ``SaveFnSaver``,
  ``RankZeroSaver`` or ``ShardedSaver`` once the session knows the ranks, in the background
  with ``background=True``;
- ``NamedSaver(directory, name, write)``: a checkpoint the framework writes itself under a name
  of its own (``resume.ckpt``, ``checkpoint-{step}``);
- ``StagedSaver(directory, "checkpoint-{step}")``: a checkpoint the framework writes by
  itself after the boundary (the Hugging Face Trainer), into a temporary that ``stage(step)``
  gives it; ``session.save(started=...)`` commits it. ``session.decide()`` says at the
  boundary whether to ask the framework for a save (``Decision.INSURANCE``) or a stop's save;
- your own: subclass ``BaseSaver`` and implement ``write(step, context)`` with
  ``self.store.save(step, ...)`` or ``self.store.commit(name, ...)``.

A framework's own ``torch.save`` calls made for a checkpoint (an optimizer's state) go inside
``with without_crc32():``, as ``NamedSaver`` and the payload do: torch's CRC32 of each record
is the CPU cost of serializing, and nothing reads it.

A front end for a loop of one's own in epochs and batches subclasses ``EpochLoop`` (the
session, the data position, ``epochs(n)``) and gives it a saver and a ``batches``.

Every checkpoint goes through ``CheckpointStore``'s commit: a temporary in the same directory,
fsync, rename, fsync of the directory. A checkpoint location may be a URL (``is_url``:
``s3://bucket/prefix``, ``gs://``, ``az://``): the store then commits in a local staging
directory and uploads each checkpoint; ``checkpoint_directory`` keeps a URL as it is, and a
stop's checkpoint reaches the bucket before the process exits; ``staged_in(url, directory)``
stages a bucket in a directory of the front end's own (the Trainer's ``output_dir``).
"""

from __future__ import annotations

from .._errors import (
    CheckpointError,
    CheckpointLoadError,
    CheckpointLockError,
    CheckpointSaveError,
    ConfigError,
    PreemptibleError,
)
from ..checkpoint._location import is_url, staged_in
from ..checkpoint._payload import capture_rng, restore_rng, without_crc32
from ..checkpoint._savers import BaseSaver, NamedSaver, PayloadSaver, Saved, SaveFnSaver, Saver
from ..checkpoint._store import Checkpoint, CheckpointStore
from ..distributed._group import Ranks
from ..distributed._savers import RankZeroSaver, ShardedSaver
from ..distributed._staged import StagedSaver
from ..stop._controller import Decision
from ..stop._latch import DEFAULT_SIGNALS, SignalLatch, normalize_signals
from ..stop._signals import signal_name
from ..stop._termination import Durations, Notice, TerminationConfig
from ._config import (
    checkpoint_directory,
    exit_code_of,
    is_rank_zero,
    saving_config,
    termination_config_of,
)
from ._loop import EpochLoop
from ._periodic import Periodic
from ._phase import Phase
from ._session import StopSession
from ._state_saver import StateSaver

__all__ = [
    "DEFAULT_SIGNALS",
    "BaseSaver",
    "Checkpoint",
    "CheckpointError",
    "CheckpointLoadError",
    "CheckpointLockError",
    "CheckpointSaveError",
    "CheckpointStore",
    "ConfigError",
    "Decision",
    "Durations",
    "EpochLoop",
    "NamedSaver",
    "Notice",
    "PayloadSaver",
    "Periodic",
    "Phase",
    "PreemptibleError",
    "RankZeroSaver",
    "Ranks",
    "SaveFnSaver",
    "Saved",
    "Saver",
    "ShardedSaver",
    "SignalLatch",
    "StagedSaver",
    "StateSaver",
    "StopSession",
    "TerminationConfig",
    "capture_rng",
    "checkpoint_directory",
    "exit_code_of",
    "is_rank_zero",
    "is_url",
    "normalize_signals",
    "restore_rng",
    "saving_config",
    "signal_name",
    "staged_in",
    "termination_config_of",
    "without_crc32",
]
