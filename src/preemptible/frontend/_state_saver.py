"""``StateSaver``: the saver of a state mapping (or a ``save_fn``), chosen once the ranks are
known: one process (``PayloadSaver``, ``SaveFnSaver``), rank 0 for every rank
(``RankZeroSaver``), or shards (``ShardedSaver``), each optionally in the background."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError
from ..checkpoint._async import POLICIES
from ..checkpoint._payload import check_state
from ..checkpoint._savers import BaseSaver, PayloadSaver, Saved, SaveFnSaver
from ..checkpoint._store import CheckpointStore
from ..distributed._savers import RankZeroSaver, ShardedSaver
from ..distributed._sharded import has_dtensor

if TYPE_CHECKING:
    from ..distributed._group import Ranks


class StateSaver:
    """Saves ``state`` (or calls ``save_fn``) in ``step-N.ckpt`` the way the run needs it."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | CheckpointStore,
        state: Mapping[str, Any] | None,
        *,
        save_fn: Callable[[Path], None] | None = None,
        keep: int = 2,
        weights_only: bool = True,
        background: bool = False,
        policy: str = "wait",
        sharded: bool = False,
    ) -> None:
        self.state = check_state(state)
        if self.state and save_fn is not None:
            raise ConfigError(
                "pass either state (preemptible saves it) or termination_config.save_fn "
                "(you save it), not both"
            )
        if not isinstance(background, bool):
            raise ConfigError(f"async_save={background!r} is not valid; use True or False")
        if policy not in POLICIES:
            raise ConfigError(f"async_policy={policy!r} is not valid; use one of wait, skip")
        if background and save_fn is not None:
            raise ConfigError(
                "async_save needs state (preemptible snapshots it); with save_fn your own code "
                "writes the checkpoint, so it cannot be taken in the background"
            )
        if not isinstance(sharded, bool):
            raise ConfigError(f"sharded={sharded!r} is not valid; use True or False")
        self.sharded = sharded or has_dtensor(self.state.mapping)
        if self.sharded and save_fn is not None:
            raise ConfigError(
                "sharded checkpoints are written by preemptible from state; with save_fn your "
                "own code writes the checkpoint"
            )
        if isinstance(directory, CheckpointStore):
            self._store = directory
        else:
            self._store = CheckpointStore(directory, keep=keep)
        self.save_fn = save_fn
        self.options: dict[str, Any] = dict(
            weights_only=weights_only, background=background, policy=policy
        )
        self.inner: BaseSaver = self._choose(None)

    def _choose(self, ranks: Ranks | None) -> BaseSaver:
        if self.sharded:
            return ShardedSaver(self._store, self.state, **self.options)
        if ranks is not None:
            return RankZeroSaver(self._store, self.state, save_fn=self.save_fn, **self.options)
        if self.save_fn is not None:
            return SaveFnSaver(self._store, self.save_fn)
        return PayloadSaver(self._store, self.state, **self.options)

    # -- Saver -----------------------------------------------------------------------------
    @property
    def store(self) -> CheckpointStore:
        return self._store

    @property
    def last_saved(self) -> Saved | None:
        return self.inner.last_saved

    @property
    def background(self) -> bool:
        return self.inner.background

    @property
    def write_seconds(self) -> float | None:
        return self.inner.write_seconds

    def attach(self, ranks: Ranks | None) -> None:
        if ranks is not None or self.sharded:
            self.inner = self._choose(ranks)
        self.inner.attach(ranks)

    def target(self, step: int) -> Path:
        return self.inner.target(step)

    def save(self, step: int, context: Any = None, *, reuse: bool = False) -> tuple[Path, bool]:
        return self.inner.save(step, context, reuse=reuse)

    def save_in_background(self, step: int, context: Any = None) -> float | None:
        return self.inner.save_in_background(step, context)

    def collect(self) -> Saved | None:
        return self.inner.collect()

    def wait(self) -> None:
        self.inner.wait()

    def resume(self, hint: Path | None) -> Saved | None:
        return self.inner.resume(hint)

    def close(self) -> None:
        self.inner.close()
