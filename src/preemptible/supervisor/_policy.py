"""The restart policy of ``preemptible run``: whether, and after how long, another attempt."""

from __future__ import annotations

import logging

from .._states import RunState, spend
from ._config import SupervisorConfig
from ._journal import Attempt

logger = logging.getLogger("preemptible")


class RestartPolicy:
    """Whether, and after how long, to start another attempt. Preemptions and failures have
    separate budgets (a preemption is not the run's fault); only failures back off."""

    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.failures = 0
        self.preemptions = 0

    def delay_after(self, attempts: list[Attempt]) -> float | None:
        """Seconds to wait before the next attempt, or None to stop (logged)."""
        c = self.config
        spent = spend(
            preempted=attempts[-1].state is RunState.PREEMPTED,
            preemptions=self.preemptions,
            failures=self.failures,
            max_preemptions=c.max_preemptions,
            max_failures=c.max_failures,
        )
        if not spent.again:
            if spent.preempted:
                logger.error(
                    "preemptible: preempted %d times; --max-preemptions is %d; giving up",
                    spent.preemptions,
                    c.max_preemptions,
                )
            elif c.max_failures:
                logger.error(
                    "preemptible: %d attempts failed or crashed; --max-failures is %d; giving up",
                    spent.failures,
                    c.max_failures,
                )
            return None
        self.preemptions, self.failures = spent.preemptions, spent.failures
        if spent.preempted:
            delay = c.restart_delay
        else:
            # the exponent is capped so that no budget can overflow the float
            backoff = c.restart_delay * 2.0 ** min(self.failures - 1, 64)
            delay = min(backoff, max(c.max_restart_delay, c.restart_delay))
        return None if self._flapping(attempts) else delay

    def _flapping(self, attempts: list[Attempt]) -> bool:
        n = self.config.flap_attempts
        recent = attempts[-n:]
        if n and len(recent) == n and all(a.duration < self.config.min_uptime for a in recent):
            logger.error(
                "preemptible: the last %d attempts each ended within %.0f s; giving up instead "
                "of restarting in a loop (look at the attempt logs above)",
                n,
                self.config.min_uptime,
            )
            return True
        return False
