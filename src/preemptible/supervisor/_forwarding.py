"""How a supervisor passes the stop signals it receives on to the job's process group.

INT, TERM, HUP, USR1 and USR2 are passed on to the whole group of the running attempt's job
(a trainer under ``bash -c`` or torchrun too). The same signal again within
``DUPLICATE_WINDOW`` (0.5 s) of the last one passed on is the same stop delivered twice (a
process tree signalled as a whole, two quick SIGTERMs from an orchestrator): it is recorded,
not passed on. A signal that arrives while no attempt is running is passed on once the next
one has started. The handler only records and calls ``killpg``; logging happens later, in
the supervisor's loop (``log_since``), which a wakeup fd wakes on every signal, SIGCHLD too.

SIGTSTP (Ctrl+Z) is job control, not a stop: the loop's next ``sleep`` stops every process of
the attempt and then the supervisor, and continues them when it is continued (``_pause``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from types import FrameType
from typing import Any

from ..stop._signals import (
    DUPLICATE_WINDOW,
    STOP_SIGNALS,
    install_handlers,
    restore_handlers,
    signal_name,
    within_duplicate_window,
)
from ._config import MAX_RESTART_DELAY
from ._journal import Received
from ._process import ProcessGroup

logger = logging.getLogger("preemptible")

FORWARDED = STOP_SIGNALS


class Forwarder:
    """The signals a supervisor received (``signals``), passed on to ``group`` while an
    attempt runs; ``forward=False`` records them only (``--no-forward-signals``).
    ``job_control``: SIGTSTP stops the job and then the supervisor (``_pause``)."""

    def __init__(self, *, forward: bool, job_control: bool = True) -> None:
        self.forward = forward
        self.job_control = job_control and forward
        self._pause_asked = False
        self.signals: list[Received] = []  # received since the supervisor started
        self.requested: list[Received] = []  # of those, the stops asked for by request()
        self.group: ProcessGroup | None = None
        self._pending: list[int] = []
        self._pending_from: int | None = None  # index in ``signals`` of the first pending
        self._last_forward: tuple[int, float] | None = None  # (signum, monotonic time)
        self._logged = 0
        self._wake_r = self._wake_w = -1
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Bookkeeping and killpg only: this runs between two bytecodes of the main loop.
        now = time.monotonic()
        last = self._last_forward
        duplicate = (
            last is not None and last[0] == signum and within_duplicate_window(now - last[1])
        )
        forward = self.forward and not duplicate
        self.signals.append(Received(signum, time.time(), forward))
        if not forward:
            return
        self._last_forward = (signum, now)
        self._pass_on(signum)

    def _pass_on(self, signum: int) -> None:
        group = self.group
        if group is not None:
            group.signal(signum)  # the whole group: a trainer under bash -c or torchrun too
        else:
            if self._pending_from is None:
                self._pending_from = len(self.signals) - 1  # the one just recorded
            self._pending.append(signum)  # the attempt is starting; passed on once it has

    def receive(self, signum: int) -> None:
        """``signum`` reached the process before these handlers were installed (an agent's
        own handler hands it over): as if it had come a moment later."""
        self._on_signal(signum, None)

    @property
    def waiting_from(self) -> int:
        """Where the next attempt's signals begin in ``signals``: the first one still waiting
        to be passed on to it (it arrived while the attempt was being prepared), else the end."""
        return len(self.signals) if self._pending_from is None else self._pending_from

    def request(self, signum: int) -> None:
        """A stop as a received ``signum`` would be, from another thread (listed in
        ``requested`` too); the wait in ``sleep`` looks again at once."""
        received = Received(signum, time.time(), True)
        self.requested.append(received)
        self.signals.append(received)
        self._last_forward = (signum, time.monotonic())
        self._pass_on(signum)
        with contextlib.suppress(OSError, ValueError):
            os.write(self._wake_w, b"\0")

    def attach(self, group: ProcessGroup) -> None:
        """The attempt's group has started: what arrived while it started is passed on now."""
        self.group = group
        while self._pending:
            group.signal(self._pending.pop(0))
        self._pending_from = None

    def log_since(self, first: int) -> None:
        """Log, outside the handler, the signals after the attempt's first one (``first``,
        an index into ``signals``: it is logged with the escalation)."""
        while self._logged < len(self.signals):
            index = self._logged
            self._logged += 1
            if index <= first:
                continue
            s, before = self.signals[index], self.signals[index - 1]
            if s.forwarded:
                logger.warning("preemptible: %s again; passed on to the job", signal_name(s.signum))
            elif self.forward:
                logger.info(
                    "preemptible: %s again %.3f s later: the same stop delivered twice "
                    "(within %.1f s), not passed on",
                    signal_name(s.signum),
                    s.at - before.at,
                    DUPLICATE_WINDOW,
                )

    def install(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
            os.set_inheritable(fd, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        # started under nohup (or as a background job): the hang-up stays ignored, here and
        # in the job, which inherits the ignored disposition
        previous, kept = install_handlers(FORWARDED, self._on_signal)
        self._previous.update(previous)
        for sig in kept:
            logger.info(
                "preemptible: %s ignored since the supervisor started; not passed on",
                signal_name(sig),
            )
        if self.job_control:  # one started ignored stays ignored
            self._previous.update(install_handlers((signal.SIGTSTP,), self._on_tstp)[0])
        # SIGCHLD needs a Python handler for the wakeup fd to see it.
        self._previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, lambda s, f: None)

    def uninstall(self) -> None:
        restore_handlers(self._previous)
        self._previous.clear()
        signal.set_wakeup_fd(-1)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def sleep(self, seconds: float) -> None:
        """Wait up to ``seconds``, returning early when any signal (SIGCHLD too) arrives."""
        if seconds > 0 and not self._pause_asked:
            with contextlib.suppress(InterruptedError):
                select.select([self._wake_r], [], [], min(seconds, MAX_RESTART_DELAY))
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 512):
                pass
        if self._pause_asked:
            self._pause()

    def _on_tstp(self, signum: int, frame: FrameType | None) -> None:
        self._pause_asked = True  # bookkeeping only; the loop's next ``sleep`` pauses

    def _pause(self) -> None:
        """Ctrl+Z: the job runs in a session of its own, which the terminal's SIGTSTP does not
        reach, so the supervisor stops every process of the attempt (SIGSTOP), then itself;
        continued (``fg``, ``bg``, SIGCONT), it continues them."""
        self._pause_asked = False
        group = self.group
        if group is not None:
            group.signal_all(signal.SIGSTOP)
        logger.warning(
            "preemptible: stopped (SIGTSTP) with the job; `fg` or `kill -CONT %d` continues both",
            os.getpid(),
        )
        # to this thread, so that it stops on its way out of the call (a kill() to the process
        # may be taken by another thread a moment later)
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        if group is not None:
            group.signal_all(signal.SIGCONT)
        logger.info("preemptible: continued; so is the job")
