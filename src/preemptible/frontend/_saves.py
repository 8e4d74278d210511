"""The saving side of a stop session: commits through the saver, what they cost, the newest one.

Each commit is timed (the grace policy budgets the final save from the measured ones, with the
last upload's time added for a bucket, since a stop's checkpoint must also reach it; the save
interval's cost is the stall the loop saw), recorded for the supervisor (the newest
checkpoint to resume from), and logged once per job (rank 0's line at INFO). Positions are the
front end's count of finished steps: a checkpoint is "of here" when it was committed at the
current position.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from .. import _run
from ..checkpoint._savers import Saver
from ..stop._termination import Durations
from ._periodic import Periodic

logger = logging.getLogger("preemptible")


class Saves:
    """Commits of one session. ``save_times``: the grace policy's record of save durations;
    ``records``: whether this process writes the run record (the session sets it once it
    knows the ranks)."""

    def __init__(
        self,
        saver: Saver,
        periodic: Periodic | None,
        save_times: Durations,
        records: bool,
    ) -> None:
        self.saver = saver
        self.periodic = periodic
        self.save_times = save_times
        self.stall_times = Durations()  # what the training loop waited for each save
        self.records = records
        self.last_end = time.monotonic()  # when the last save ended (the interval's start)
        self.newest: tuple[int, Path] | None = None  # (position, path) of the newest commit
        self.started: int | None = None  # the position of the newest save started
        self.resumed_at: int | None = None  # the position this run resumed from
        self._background: tuple[int, int] | None = None  # (step, position) in flight
        self._warned_same_step = False

    def of(self, at: int) -> Path | None:
        """The committed checkpoint of position ``at``, if any."""
        if self.newest is not None and self.newest[0] == at:
            return self.newest[1]
        return None

    def note(self, path: Path, at: int) -> None:
        """A checkpoint of position ``at`` exists already (resumed from)."""
        self.newest, self.started = (at, path), at

    def due(self, pos: int, since: int, total: int | None) -> bool:
        periodic = self.periodic
        return periodic is not None and periodic.due(
            pos, since, total, time.monotonic(), self.last_end
        )

    def save(
        self,
        step: int,
        at: int,
        context: Any,
        *,
        reuse: bool = False,
        started: float | None = None,
    ) -> Path:
        """Commit a checkpoint of ``step`` now (after the one in flight, if any).
        ``started``: when the framework began writing it (it is timed from there)."""
        self.saver.wait()  # commit order = step order: the one in flight goes first
        self.collect()
        same = self.resumed_at == at and self.of(at) is not None
        if same and not reuse and not self._warned_same_step:
            self._warned_same_step = True
            logger.warning(
                "preemptible: save() at step %d, the step this run resumed from: if the loop "
                "trained since, this checkpoint claims the wrong step. In a loop of your own set "
                "handler.step = step + 1 after each step (or use steps()/run())",
                step,
            )
        if started is None:
            started = time.monotonic()
        path, written = self.saver.save(step, context, reuse=reuse)
        self.newest, self.started = (at, path), at
        if not written:
            return path
        seconds = time.monotonic() - started
        self.save_times.add(seconds)
        self.stall_times.add(seconds)
        self.last_end = time.monotonic()
        cost = None
        if self.periodic is not None:
            self.periodic.observe(seconds)
            cost = self.periodic.save_cost()
        self._record(path, step, save_s=cost)
        self._log("preemptible: saved %s (step %d, %.2f s)", path, step, seconds)
        return path

    def in_background(self, step: int, at: int, context: Any) -> None:
        """Snapshot the state here, write it in the background."""
        self.collect()
        self.started = at  # on every rank alike, whether or not this one writes
        stall = self.saver.save_in_background(step, context)
        if stall is not None:
            self._background = (step, at)
            self.stall_times.add(stall)
            if self.periodic is not None:
                self.periodic.observe(stall, write=self.saver.write_seconds)
        self.last_end = time.monotonic()  # skipped too: the next point is an interval away

    def collect(self) -> None:
        """Take what the background writer finished."""
        done = self.saver.collect()
        if done is None:
            return
        step, path = done
        if self._background is not None and self._background[0] == step:
            self.newest = (self._background[1], path)
        if self.saver.write_seconds is not None:
            self.save_times.add(self.saver.write_seconds)
        self._record(path, step)
        self._log("preemptible: saved %s in the background (step %d)", path, step)

    def _record(self, path: Path, step: int, save_s: float | None = None) -> None:
        """The newest committed checkpoint, for the supervisor's next resume (rank 0)."""
        if not self.records:
            return
        fields: dict[str, Any] = {"resume_from": str(path.resolve()), "resume_step": step}
        if save_s is not None:
            fields["save_s"] = round(save_s, 3)
        _run.update_record(**fields)

    def _log(self, message: str, *args: Any) -> None:
        """Every rank saves together; one line of it (rank 0's) is enough at INFO."""
        logger.log(logging.INFO if self.records else logging.DEBUG, message, *args)
