"""Expiry on SQLite without a shared wall clock: a run's renewals as one agent sees them.

PostgreSQL has one clock for every agent, the server's (``preemptible_now()``), and a lease
ends when that clock passes it. SQLite has none: each process registers its own wall clock as
``preemptible_now()``, so a process whose clock runs ahead (a host's clock set wrong, a
``faketime``) would find every lease long expired and take a healthy run over, and the holder
would then kill its own run. Wall clocks are not compared across processes here at all.

Instead the holder bumps a counter at each renewal (``lease_beats``), and each would-be taker
notes, on its own monotonic clock, when it first saw the run's (claim epoch, counter) pair. A
lease is expired *for that agent* once the pair has stayed the same for the lease; another
host's holder is gone only once it stayed the same for the lease and its margin
(``_endings.gone``). The holder's own deadline is on its monotonic clock too and counts from
the start of its last successful renewal, which came before the taker could see that renewal's
counter: the holder's run is gone ``2 * margin`` before anyone may take it. Only elapsed times
are compared, each on one process's clock; clocks that run at different rates are what the
margin is for (``LEASE_MARGIN``). An agent that starts while a holder is already dead waits a
lease and its margin from its first look; on the holder's own host its liveness decides at once,
as before.
"""

from __future__ import annotations

import time
from collections.abc import Iterable


class BeatWatch:
    """When this process first saw each running run's (epoch, renewal counter) pair."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, int, float]] = {}

    def unchanged_for(self, run_id: str, epoch: int, beats: int) -> float:
        """Seconds (this process's monotonic clock) since the run's lease was last seen to
        change: 0 the first time a pair is seen."""
        now = time.monotonic()  # looked up at each call: a test may stand in for it
        seen = self._seen.get(run_id)
        if seen is None or seen[:2] != (epoch, beats):
            self._seen[run_id] = (epoch, beats, now)
            return 0.0
        return now - seen[2]

    def keep(self, running: Iterable[str]) -> None:
        """Forget runs that are no longer running."""
        keep = set(running)
        for run_id in [r for r in self._seen if r not in keep]:
            del self._seen[run_id]
