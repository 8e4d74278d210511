"""Ctrl+Z without freezing the queue: an agent stopped from its terminal stops between two
database transactions, never inside one.

A process stopped inside a transaction keeps what the transaction holds. SQLite's write lock
is a lock on the file that nobody can break while its holder lives, so an agent stopped
(SIGSTOP) in the milliseconds of a write would keep every other agent of the sweep from
writing until it is continued; PostgreSQL keeps the rows it locked until the server ends the
session (``_postgres``: ``idle_in_transaction_session_timeout``).

SIGSTOP cannot be caught, but the terminal's Ctrl+Z sends SIGTSTP, which can: the agent's
handler only records it; a thread then closes the ``GATE`` (no new transaction starts), waits
for those under way to end (``GATE_WAIT`` at most: a transaction stuck on an unreachable
server does not keep Ctrl+Z from working), and stops the process with a SIGSTOP sent to
itself. When the process is continued (``fg``, SIGCONT), the thread opens the gate again. The
main thread waiting for SQLite's lock takes the signal when that wait ends (Python runs
handlers between its own instructions), so a Ctrl+Z may take up to the busy timeout there.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

from ...stop._signals import install_handlers, restore_handlers

logger = logging.getLogger("preemptible")

GATE_WAIT = 5.0  # seconds a Ctrl+Z waits for the transactions under way, at most
POLL = 0.05  # seconds between the thread's looks at what the handler recorded


class Gate:
    """Counts the transactions under way in this process; ``closed()`` waits for them to end
    and keeps new ones from starting. A thread already inside passes again (a transaction
    opened inside another)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._closed = False
        self._depth = threading.local()

    @contextlib.contextmanager
    def passage(self) -> Iterator[None]:
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            with self._cond:
                while self._closed:
                    self._cond.wait()
                self._inside += 1
        self._depth.n = depth + 1
        try:
            yield
        finally:
            self._depth.n = depth
            if depth == 0:
                with self._cond:
                    self._inside -= 1
                    self._cond.notify_all()

    @contextlib.contextmanager
    def closed(self, wait: float) -> Iterator[bool]:
        """Closed for the body: True when no transaction is under way, False when some were
        still under way after ``wait`` seconds."""
        deadline = time.monotonic() + wait
        with self._cond:
            self._closed = True
            while self._inside and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            idle = self._inside == 0
        try:
            yield idle
        finally:
            with self._cond:
                self._closed = False
                self._cond.notify_all()


GATE = Gate()  # every connection of the process passes it (``Connector.transact``)


class CtrlZ:
    """While installed (main thread): SIGTSTP stops this process between transactions."""

    def __init__(self, gate: Gate = GATE) -> None:
        self._gate = gate
        self._asked = False  # a plain flag: the handler takes no lock
        self._previous: dict[int, Any] = {}
        self._thread: threading.Thread | None = None

    def _on_tstp(self, signum: int, frame: FrameType | None) -> None:
        self._asked = True  # bookkeeping only; the thread sees it and stops the process

    def install(self) -> None:
        """Take SIGTSTP (main thread only); one started ignored stays ignored."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous, kept = install_handlers((signal.SIGTSTP,), self._on_tstp)
        if kept:
            return
        self._previous = previous
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._loop, name="preemptible-ctrl-z", daemon=True
            )
            self._thread.start()

    def restore(self) -> None:
        restore_handlers(self._previous, ours=self._on_tstp)
        self._previous = {}  # the thread ends at its next look

    def _loop(self) -> None:
        while self._previous:
            time.sleep(POLL)
            if not self._asked:
                continue
            self._asked = False
            with self._gate.closed(GATE_WAIT) as idle:
                if not idle:
                    logger.warning(
                        "preemptible: stopping (Ctrl+Z) with a database transaction still "
                        "under way after %.0f s",
                        GATE_WAIT,
                    )
                # to this thread (tgkill), not to the process: sent with kill(), the stop may
                # be taken by another thread a moment later, while this one has already gone
                # on and opened the gate; this thread stops on its way out of the call
                signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
