"""Periodic saves: every N steps, every S seconds of training, or the Young/Daly interval.

A periodic checkpoint is insurance against what no signal announces (a SIGKILL, a lost
machine). The stop session asks ``due`` at every step boundary: one or two comparisons.
"""

from __future__ import annotations

from .._errors import ConfigError
from ..checkpoint._interval import SaveInterval, _seconds


class Periodic:
    """When the next periodic save is due. ``every_steps``: an integer >= 1, or "auto" (the
    Young/Daly interval in seconds, from the measured save cost and the interruption rate);
    ``every_seconds``: seconds of training between two saves."""

    def __init__(
        self, *, every_steps: int | str | None = None, every_seconds: float | None = None
    ) -> None:
        whole = isinstance(every_steps, int) and not isinstance(every_steps, bool)
        if every_steps not in (None, "auto") and not (whole and every_steps >= 1):  # type: ignore[operator]
            raise ConfigError(
                f"save_every_steps={every_steps!r} is not valid; use None, an integer >= 1 "
                "or 'auto'"
            )
        if every_seconds is not None and every_steps is not None:
            raise ConfigError(
                "pass save_every_steps or save_every_seconds, not both (save_every_steps='auto' "
                "chooses the interval in seconds for you)"
            )
        self.every_steps = every_steps if isinstance(every_steps, int) else None
        self.interval: SaveInterval | None = None
        if every_seconds is not None:
            self.interval = SaveInterval(
                every=_seconds("save_every_seconds", every_seconds), platform="local"
            )
        elif every_steps == "auto":
            self.interval = SaveInterval()

    @classmethod
    def of(cls, every_steps: int | str | None, every_seconds: float | None) -> Periodic | None:
        """The periodic saves a front end's ``save_every_steps``/``save_every_seconds`` ask
        for; None when neither is given."""
        if every_steps is None and every_seconds is None:
            return None
        return cls(every_steps=every_steps, every_seconds=every_seconds)

    @property
    def by_time(self) -> bool:
        """Due by the clock (which is not the same on every rank: rank 0 decides)."""
        return self.interval is not None

    def due(self, position: int, since: int, total: int | None, now: float, last: float) -> bool:
        """Whether a save point lies after ``since`` up to ``position`` (or it is ``total``);
        ``last``: when the last save ended (monotonic)."""
        if self.every_steps is not None:
            every = self.every_steps
            return position // every > since // every or position == total
        if self.interval is not None:
            return position == total or self.interval.due(now, last)
        return False

    def observe(self, stall: float, write: float | None = None) -> None:
        """A save's cost as the training loop saw it (and its background write, if any)."""
        if self.interval is not None:
            self.interval.observe_save(stall, write=write)

    def save_cost(self) -> float | None:
        """The save cost the interval is computed from (for the run record), if by time."""
        return None if self.interval is None else self.interval.save_cost()[0]

    def describe(self) -> str:
        if self.interval is not None:
            return self.interval.describe()
        return f"every {self.every_steps} steps"
