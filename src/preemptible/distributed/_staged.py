"""``StagedSaver``: a checkpoint directory that the framework writes by itself, later than the
boundary, into a temporary of the store (the Hugging Face Trainer's ``checkpoint-N``).

The front end asks for a save at a boundary and ``stage(step)`` gives it a temporary *parent*
directory (``.tmp-checkpoint-N.<host>.<pid>.<hex>``, a name that no reader of committed
checkpoints matches, removed as stale after a kill); the framework writes its checkpoint under
its own name inside it; ``save(step)`` then commits that checkpoint: fsync of everything in it,
rename to ``directory/<name>``, fsync of the directory. Under torch.distributed rank 0 makes
the temporary and tells the others where it is; every rank writes its part into it, says so,
and rank 0 commits once all have. ``keep=None``: nothing is pruned (the framework's own
retention runs over committed checkpoints only, after the commit).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .._errors import CheckpointSaveError, ConfigError
from .._files import remove_path
from ..checkpoint._savers import BaseSaver, step_pattern
from ..checkpoint._store import CheckpointStore
from ._group import Ranks, hear_written

_KEEP_ALL = 2**31 - 1


class StagedSaver(BaseSaver):
    """See the module docstring. ``name`` has ``{step}`` in it (``checkpoint-{step}``)."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | CheckpointStore,
        name: str,
        *,
        keep: int | None = None,
    ) -> None:
        if not isinstance(name, str) or name.count("{step}") != 1 or "/" in name:
            raise ConfigError(f"name={name!r} is not valid; use a name with {{step}} once in it")
        if isinstance(directory, CheckpointStore):
            store = directory
        else:
            store = CheckpointStore(directory, keep=_KEEP_ALL if keep is None else keep)
        super().__init__(store)
        self._name = name
        self.pattern = step_pattern(name)
        self.prunes = keep is not None
        self._staged: tuple[int, Path] | None = None  # (step, temporary parent)
        self._key: str | None = None

    def name(self, step: int) -> str:
        return self._name.replace("{step}", str(step))

    def target(self, step: int) -> Path:
        return self.store.directory / self.name(step)

    @property
    def staged(self) -> Path | None:
        """Where the framework's checkpoint of the staged step is written (in the temporary)."""
        if self._staged is None:
            return None
        step, parent = self._staged
        return parent / self.name(step)

    def stage(self, step: int) -> Path:
        """A temporary parent directory for the framework's save of ``step`` (the same on
        every rank: call it on every rank at the same boundary)."""
        if self._staged is not None:
            self.discard()
        ranks: Ranks | None = self.ranks
        key = ranks.next_key("staged") if ranks is not None else None
        if ranks is None or ranks.is_zero:
            parent = self.store.temporary(self.name(step))
            parent.mkdir()
            if ranks is not None and key is not None:
                ranks.announce(key, {"dir": parent.name})
        else:
            assert key is not None
            heard = ranks.hear(key, "rank 0's temporary checkpoint directory")
            parent = self.store.directory / str(heard.get("dir"))
        self._staged, self._key = (step, parent), key
        return parent

    def discard(self) -> None:
        """The staged save did not come (or is over): rank 0 removes the temporary."""
        staged, self._staged = self._staged, None
        if staged is not None and (self.ranks is None or self.ranks.is_zero):
            remove_path(staged[1])

    def write(self, step: int, context: Any) -> Path:
        staged, key = self._staged, self._key
        final = self.target(step)
        if staged is None or staged[0] != step:
            raise CheckpointSaveError(f"no save of step {step} was written for {final}", final)
        ranks: Ranks | None = self.ranks
        if ranks is not None and key is not None and not ranks.is_zero:
            ranks.announce(f"{key}/written/{ranks.rank}", {})  # this rank's part is in
            self._staged = None
            return final
        try:
            if ranks is not None and key is not None:
                hear_written(ranks, key, staged[1])
            written = staged[1] / self.name(step)
            if not written.is_dir() and not written.is_file():
                raise CheckpointSaveError(f"the framework wrote no {written}", final)
            path = self.store.commit(self.name(step), lambda tmp: os.rename(written, tmp))
        finally:
            self.discard()
        if self.prunes:
            self.store.prune(step, keep_path=path, pattern=self.pattern)
        return path
