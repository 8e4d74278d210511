"""A stop when the run's supervisor and its guardian are both gone.

Under ``preemptible run`` or ``preemptible agent`` the supervisor holds ``supervisor.lock`` of
the run (``flock``) for its whole life, and the attempt's guardian holds the same lock. If both
are killed at once (``kill -9`` of the two, an OOM kill of a cgroup, ``pkill -9 -f
preemptible``), nobody is left to stop the attempt: a training process would train on as an
orphan, holding the checkpoint lock that the next attempt needs. This source sees the lock
go: the lock is looked up in the kernel's table (``/proc/locks``), never taken, so that it can
never turn a starting supervisor away. It arms only once it has seen the lock held (where the
table cannot show it, a network file system, it stays silent), and a stop needs two looks in
a row without the lock. The run then stops as on any notice: at the next step, with a
checkpoint, which the next attempt resumes from.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .._files import file_id, held_flocks
from ..stop._termination import Notice


class SupervisorGone:
    name = "supervisor"

    def __init__(self, lock: Path) -> None:
        self.lock = lock
        self.display = str(lock)
        self._held: tuple[int, int, int] | None = None  # the lock's file, once seen held
        self._missing = 0

    def poll(self) -> Notice | None:
        held = held_flocks()
        if self._held is None:  # the file as it is now; from then on that file, whatever
            try:  # becomes of its name (a run directory deleted under the run)
                st = os.lstat(self.lock)
            except OSError:
                return None
            identity = file_id(st)
            if stat.S_ISREG(st.st_mode) and identity in held:
                self._held = identity
            return None
        if self._held in held:
            self._missing = 0
            return None
        self._missing += 1
        if self._missing < 2:
            return None
        return Notice(
            source="supervisor",
            detail=f"the run's supervisor and guardian are gone ({self.display} is not held)",
        )


def for_this_attempt(run_dir: str | None) -> SupervisorGone | None:
    """The source for an attempt started with ``PREEMPTIBLE_RUN_DIR=run_dir``, if its run's
    lock is there (``RUN_DIR/../supervisor.lock``)."""
    if not run_dir:
        return None
    lock = Path(run_dir).parent / "supervisor.lock"
    return SupervisorGone(lock) if lock.is_file() else None
