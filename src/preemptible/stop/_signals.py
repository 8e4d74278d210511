"""The stop signals, and how every part of preemptible installs and restores handlers for them.

One set, one rule for ignored signals, one duplicate window, for the latch (the training
process), the supervisor (``preemptible run``), the agent and the guardian (which ignores them
all: it runs as a script of its own, and a test checks that its tuple is this one).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import Any

Handler = Callable[[int, FrameType | None], Any] | int | None

STOP_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
)

# Signals a process keeps ignoring when it started with them ignored (POSIX convention; Python
# itself leaves an inherited SIG_IGN for SIGINT alone): started under nohup or as a background
# job, the hang-up or the terminal's Ctrl+C was not meant for it; an agent started with
# Ctrl+Z (SIGTSTP) ignored is not to be stopped from a terminal.
KEEP_IGNORED: frozenset[int] = frozenset({signal.SIGHUP, signal.SIGINT, signal.SIGTSTP})

# Two deliveries of the same signal this close together are one stop delivered twice (a
# process tree signalled as a whole, then again by `preemptible run`'s forwarding; systemd's
# control-group kill; two quick SIGTERMs from an orchestrator), not a person's second signal.
# A deliberate second Ctrl+C comes later than this and still exits at once.
DUPLICATE_WINDOW = 0.5


def within_duplicate_window(elapsed: float) -> bool:
    """Whether a signal ``elapsed`` seconds after an earlier one is that stop delivered again."""
    return elapsed <= DUPLICATE_WINDOW


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def install_handlers(
    signals: Iterable[int], handler: Handler
) -> tuple[dict[int, Handler], tuple[int, ...]]:
    """Install ``handler`` for each of ``signals`` but those of ``KEEP_IGNORED`` this process
    started with ignored: (the handlers it replaced, by signal; the signals kept ignored).
    Main thread only, as Python's ``signal.signal``."""
    previous: dict[int, Handler] = {}
    kept = []
    for sig in signals:
        current = signal.getsignal(sig)
        if sig in KEEP_IGNORED and current == signal.SIG_IGN:
            kept.append(sig)
            continue
        previous[sig] = current
        signal.signal(sig, handler)
    return previous, tuple(kept)


def restore_handlers(previous: Mapping[int, Handler], *, ours: Handler | None = None) -> list[int]:
    """Put back the handlers ``install_handlers`` replaced (the default where Python knew of
    none). With ``ours``, a signal whose handler is no longer ``ours`` is left alone: someone
    installed theirs over it, and restoring on top would break their own restore later.
    Returns the signals left alone."""
    left = []
    for sig, prev in previous.items():
        if ours is not None and signal.getsignal(sig) != ours:
            left.append(sig)
            continue
        signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
    return left
