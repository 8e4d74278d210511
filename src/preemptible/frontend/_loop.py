"""``EpochLoop``: what a front end for a loop of one's own in epochs and batches shares.

Such a front end (``preemptible.accelerate``, ``preemptible.jax``) keeps the user's loop and
tells the kit where its boundaries are: ``epochs(n)`` yields the epochs from the resumed one,
the end of each being a boundary, and the front end's ``batches(...)`` yields an epoch's
batches, the moment the loop asks for the next one being the step's boundary. This class holds
the session and the position (``step``, ``epoch``, ``batch`` and the random states as the
resumed epoch began), restores it from the saver's resumed checkpoint, and runs ``epochs``;
the front end gives the saver (which reads the position back into ``saver.position``) and its
``batches``, and may act as each epoch begins (``_epoch_begins``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from ..distributed._group import Ranks
from ..stop._termination import TerminationConfig
from ._config import exit_code_of
from ._periodic import Periodic
from ._session import StopSession


class EpochLoop:
    """The session and the data position of a loop in epochs and batches; resumed at once.

    ``saver``: the front end's, with ``position`` (the resumed checkpoint's, or None) and
    ``store``. ``step``: batches trained so far; ``epoch``, ``batch``: the epoch under way and
    the batches of it trained.
    """

    def __init__(
        self,
        saver: Any,
        *,
        termination_config: TerminationConfig,
        signals: Iterable[int | str] | None,
        tracker: Any | None,
        periodic: Periodic | None,
        exit_code: int | None,
        ranks: Ranks | None = None,
    ) -> None:
        self.saver = saver
        self.session = StopSession(
            saver,
            termination_config=termination_config,
            signals=signals,
            tracker=tracker,
            periodic=periodic,
            exit_code=exit_code_of(exit_code),
            ranks=ranks,
        )
        self.session.start()
        try:
            self.session.begin()  # the newest checkpoint, restored by the saver
        except BaseException:
            self.session.close()
            raise
        position = saver.position or {}
        self.step: int = self.session.step
        self.epoch: int = int(position.get("epoch", 0))
        self.batch: int = int(position.get("batch", 0))
        # the random states as the resumed epoch began (None: not resumed mid-epoch)
        self._epoch_rng: dict[str, Any] | None = position.get("epoch_rng")

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.saver.store.directory)

    @property
    def resume_path(self) -> Path | None:
        """The ``checkpoint-N`` this run resumed from, or None."""
        return self.session.resume_path

    def epochs(self, total: int) -> Iterator[int]:
        """The epochs from the resumed one up to ``total - 1``. The end of each (after the
        loop's evaluation) is a boundary; the end of the last commits the last step."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ConfigError(f"total={total!r} is not valid; use an integer >= 0")
        return self._epochs(total)

    def _epochs(self, total: int) -> Iterator[int]:
        session = self.session
        try:
            while self.epoch < total:
                self._epoch_begins()
                yield self.epoch
                self.epoch, self.batch, self._epoch_rng = self.epoch + 1, 0, None
                if session.at_boundary(step=self.step, context=self._position()):
                    return
            session.finished(step=self.step, context=self._position(), always=True)
        except Exception:
            session.failed()
            raise
        finally:
            session.close()

    def _epoch_begins(self) -> None:
        """Called as each epoch begins, before it is yielded."""

    def _position(self) -> dict[str, Any]:
        """What a checkpoint holds of the position, beside the framework's state."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch": self.batch,
            "epoch_rng": self._epoch_rng,
        }
