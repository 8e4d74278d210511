"""Before its first attempt, a supervisor stops what earlier attempts of its run left running.

Their supervisor and its guardian were killed together (``kill -9`` of both, a container's
whole process tree), so no one stopped them: SIGTERM first, so that a trainer saves, then
SIGKILL a term timeout later. The next attempt resumes from that save instead of meeting a
checkpoint lock that an orphan holds. Finding them is ``EarlierAttempts`` (``_process.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from ._process import EarlierAttempts

logger = logging.getLogger("preemptible")


def stop_earlier_attempts(
    run_dir: Path,
    run_id: str,
    *,
    term_timeout: Callable[[], tuple[float, str]],
    stopped: Callable[[], bool],
    sleep: Callable[[float], None],
) -> None:
    """Stop the processes earlier attempts of run ``run_id`` left running: SIGTERM, then
    SIGKILL ``term_timeout()`` seconds later, or at once when ``stopped()`` (the supervisor
    was told to stop); ``sleep`` waits, waking for signals."""
    earlier = EarlierAttempts(run_dir, run_id)
    left = earlier.alive()
    if not left:
        return
    timeout, source = term_timeout()
    logger.warning(
        "preemptible: %d process(es) of an earlier attempt of run %s are still running "
        "without their supervisor (pids %s); stopping them before the next attempt: "
        "SIGTERM, SIGKILL in %.0f s (%s)",
        len(left),
        run_id,
        ", ".join(map(str, sorted(left))),
        timeout,
        source,
    )
    earlier.terminate()
    deadline = time.monotonic() + timeout
    while earlier.alive() and not stopped() and time.monotonic() < deadline:
        sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))
    if earlier.alive():
        earlier.kill()
    earlier.remove_cgroups()
    if earlier.alive():
        logger.error(
            "preemptible: processes %s of an earlier attempt survive SIGKILL",
            ", ".join(map(str, sorted(earlier.alive()))),
        )
