"""Signal handlers a test installs in the test process, put back whatever the test does.

A handler left behind (a stopped fit keeps its handler; a failed assertion skips the
restore line) would reach every later test in the process: the ``signal_handlers`` fixture
records the handler before each change and restores them all at teardown, on every path.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from types import FrameType

import pytest

Handler = Callable[[int, FrameType | None], object] | int | None  # what getsignal returns


class SignalHandlers:
    def __init__(self) -> None:
        self._before: dict[int, Handler] = {}

    def keep(self, *signals: int) -> None:
        """Restore these signals' current handlers at teardown, whoever replaces them."""
        for sig in signals:
            self._before.setdefault(sig, signal.getsignal(sig))

    def install(self, handler: Handler, *signals: int) -> None:
        """``signal.signal(sig, handler)`` for each signal, the one before kept for teardown."""
        self.keep(*signals)
        for sig in signals:
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def restore(self) -> None:
        for sig, handler in self._before.items():
            if handler is not None:  # None: installed outside Python, cannot be put back
                signal.signal(sig, handler)
        self._before.clear()


@pytest.fixture
def signal_handlers() -> Iterator[SignalHandlers]:
    """``signal_handlers.install(handler, *signals)`` / ``.keep(*signals)``; all restored."""
    handlers = SignalHandlers()
    try:
        yield handlers
    finally:
        handlers.restore()
