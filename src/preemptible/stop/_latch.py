"""The signal latch: the first signal asks for a stop, the second one exits at once.

Why a latch and not "save in the handler": Python runs a signal handler in the main thread
between two bytecodes, i.e. in the middle of whatever the training step was doing. A
checkpoint taken there mixes half-updated parameters with the optimizer state, and under
torch.distributed a save is a collective that hangs when only one rank got the signal. So
the handler only records -- an append to a list -- and everything else (the log line, the
checkpoint) happens at the next step boundary in ordinary code. Even logging is kept out of
the handler: a signal that lands while the main thread writes to the same stream makes the
stream raise "reentrant call", and user log handlers are not written for signal context.

The rules, in order:

- a signal within ``DUPLICATE_WINDOW`` of the first is the same stop delivered twice (a whole
  process tree signalled and then again by a forwarding supervisor, systemd's control-group
  kill): recorded, not acted on;
- once the checkpoint of the stop is committed (``hold_for_exit``), any further signal exits at
  once with the stop's documented code, and during interpreter shutdown the signals are
  ignored, so the process never dies "killed by SIGTERM" after it saved;
- otherwise a second signal exits at once with code 1 (the previous checkpoint stays valid).

SIGHUP and SIGINT are left alone when the process started with them ignored (``nohup``, a
background job of a shell): whoever asked to survive a hang-up must not be stopped by one.

Forked children (DataLoader workers, user ``multiprocessing`` pools) inherit Python-level
handlers. The handler compares ``os.getpid()`` with the pid that installed it and does
nothing in any other process, so a signal sent to the whole process group neither stops the
run twice nor kills a worker through a stale copy of this object.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from .._logs import prefix
from ._signals import (
    DUPLICATE_WINDOW,
    STOP_SIGNALS,
    install_handlers,
    restore_handlers,
    signal_name,
    within_duplicate_window,
)
from ._termination import Notice

logger = logging.getLogger("preemptible")

DEFAULT_SIGNALS = STOP_SIGNALS  # the latch's default: every stop signal

_Handler = Callable[[int, FrameType | None], Any] | int | None


def normalize_signals(signals: Iterable[int | str] | None) -> tuple[signal.Signals, ...]:
    """Accept signal numbers, ``signal.Signals`` members or names like "TERM" / "SIGTERM"."""
    from .._errors import ConfigError

    if signals is None:
        return DEFAULT_SIGNALS
    out: list[signal.Signals] = []
    for item in signals:
        try:
            if isinstance(item, str):
                name = item.upper()
                sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
            else:
                sig = signal.Signals(item)
        except (KeyError, ValueError):
            valid = ", ".join(s.name for s in DEFAULT_SIGNALS)
            raise ConfigError(
                f"unknown signal {item!r}; use a signal number or a name such as {valid}"
            ) from None
        except TypeError:
            raise ConfigError(
                f"signal {item!r} is not valid; use a signal number or a name such as TERM"
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"{sig.name} cannot be caught; choose catchable signals like SIGTERM")
        if sig not in out:
            out.append(sig)
    if not out:
        raise ConfigError("signals is empty; pass None for the default INT, TERM, USR1, USR2")
    return tuple(out)


class SignalLatch:
    """Installs handlers for ``signals`` in the calling process and restores them on ``restore()``.

    ``notify`` is called (in the main thread, inside the handler) with a ``Notice`` on the
    first signal only; it must be cheap and must not block. ``log_pending()`` writes the log
    lines of signals received since its last call; front ends call it at their boundaries.
    """

    def __init__(self, signals: Iterable[int], notify: Callable[[Notice], None]) -> None:
        self.signals: tuple[int, ...] = tuple(signals)
        self._notify = notify
        self._owner_pid = os.getpid()
        self._previous: dict[int, _Handler] = {}
        self._received: list[tuple[int, float]] = []
        self._logged = 0
        self._exit_code: int | None = None  # set once the stop's checkpoint is committed
        self.kept_ignored: tuple[int, ...] = ()

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    @property
    def holding(self) -> bool:
        """Whether ``hold_for_exit`` is in force (the stop is committed, the exit under way)."""
        return self._exit_code is not None and bool(self._previous)

    @property
    def received(self) -> list[tuple[int, float]]:
        """(signum, wall time) of every signal handled so far, oldest first."""
        return list(self._received)

    def handles(self, handler: object) -> bool:
        """Whether ``handler`` is this latch's handler (e.g. found in someone's snapshot)."""
        return handler == self._handle

    def previous(self, sig: int) -> _Handler:
        """The handler that was installed for ``sig`` before this latch."""
        return self._previous.get(sig, signal.SIG_DFL)

    def reclaim(self) -> None:
        """Put this latch's handler back where someone installed theirs over it."""
        if not self._previous or os.getpid() != self._owner_pid:
            return
        for sig in self._previous:
            if signal.getsignal(sig) != self._handle:
                signal.signal(sig, self._handle)

    def install(self) -> bool:
        """Install the handlers; False (with a warning) when that is impossible here."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "preemptible: created off the main thread (%s); Python only lets the main thread "
                "install signal handlers, so %s will not trigger a checkpoint. Create the handler "
                "in the main thread, or use a termination_watcher_fn.",
                threading.current_thread().name,
                "/".join(signal_name(s) for s in self.signals),
            )
            return False
        self._owner_pid = os.getpid()
        # started under nohup / as a background job, a hang-up or Ctrl+C stays ignored
        previous, kept = install_handlers(self.signals, self._handle)
        self._previous.update(previous)
        self.kept_ignored = kept
        if kept:
            logger.info(
                "preemptible: %s ignored since this process started (nohup or a background "
                "job); it stays ignored and will not stop the run",
                "/".join(signal_name(s) for s in kept),
            )
        _register_guard(self)
        return True

    def restore(self) -> None:
        """Put back the handlers that were there before; safe to call more than once."""
        if not self._previous or os.getpid() != self._owner_pid:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "preemptible: close() called off the main thread; the signal handlers stay "
                "installed until close() runs in the main thread"
            )
            return
        for sig in restore_handlers(self._previous, ours=self._handle):
            # Someone installed a handler over ours; theirs stays.
            logger.debug("preemptible: %s handler was replaced; leaving it", signal_name(sig))
        self._previous.clear()
        self._exit_code = None
        _unregister_guard(self)
        if self in _holding:
            _holding.remove(self)

    def pass_on(self, seen: int) -> None:
        """Once the handlers that were there before are back (``restore``): deliver the first
        signal received after the first ``seen`` (those a boundary decided about) to the
        handler now in place. By default it ends the process, as it would have without
        preemptible; a handler of the program's own gets it."""
        late = self._received[seen:]
        if not late or self._previous:
            return
        logger.warning(
            "preemptible: %s arrived after training finished; passing it on",
            signal_name(late[0][0]),
        )
        signal.raise_signal(late[0][0])

    def hold_for_exit(self, code: int) -> None:
        """The stop's checkpoint is committed and the process is about to exit with ``code``:
        from now on a signal exits at once with ``code``, and during interpreter shutdown
        (after atexit) the signals are ignored. ``restore()`` undoes this (for an ``exit_fn``
        that returns instead of exiting)."""
        self._exit_code = code
        if self._previous and self not in _holding:
            _holding.append(self)
            _register_atexit()

    def log_pending(self) -> None:
        """Log the signals received since the last call (outside the signal handler)."""
        received = self._received
        while self._logged < len(received):
            signum, at = received[self._logged]
            name = signal_name(signum)
            if self._logged == 0:
                logger.warning(
                    "preemptible: received %s; finishing the current step, then saving a "
                    "checkpoint and exiting (send it again, %.1f s or more later, to exit at once "
                    "without saving)",
                    name,
                    DUPLICATE_WINDOW,
                )
            else:
                first_at = received[0][1]
                logger.warning(
                    "preemptible: received %s again %.3f s after the first; the same stop "
                    "delivered twice (within %.1f s), not acted on",
                    name,
                    at - first_at,
                    DUPLICATE_WINDOW,
                )
            self._logged += 1

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Bookkeeping only: no logging, no locks, no I/O but the raw write before os._exit.
        if os.getpid() != self._owner_pid:
            return  # a forked child with an inherited copy of this handler: not ours to act on
        now = time.time()
        entry = (signum, now)
        received = self._received
        received.append(entry)
        # The first signal is the one whose entry went in first; not "the list holds one":
        # Python runs the handler of a signal that arrives while this one runs inside this
        # one (at its next call), so two SIGTERMs at once can both append before either
        # counts, and neither would then notify: the stop would be lost.
        if received[0] is entry:
            self._notify(Notice(source=signal_name(signum), received_at=now, signum=signum))
            return
        if self._exit_code is not None:
            _raw_stderr(
                f"{prefix()}received {signal_name(signum)} after the checkpoint was "
                f"committed; exiting now with {self._exit_code}{_exit_note}\n"
            )
            os._exit(self._exit_code)
        if within_duplicate_window(now - received[0][1]):
            return  # the same stop delivered twice; logged by log_pending()
        _raw_stderr(
            f"{prefix()}received {signal_name(signum)} again; exiting now without saving "
            "(the checkpoints committed before stay as they are)\n"
        )
        os._exit(1)


def _raw_stderr(text: str) -> None:
    """Write from a signal handler: straight to fd 2, never through a Python stream."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode("utf-8", "replace"))


# --- the way out after a committed stop ---------------------------------------------------
#
# CPython puts SIG_DFL back for every signal with a Python handler while it finalizes, and
# finalizing with torch loaded takes ~0.4 s. A SIGTERM in that window (a supervisor, SLURM or
# a second notice) would kill a process that had already saved and chosen its exit code. From
# atexit on, the latched signals are ignored instead: the process is leaving anyway.

_holding: list[SignalLatch] = []
_atexit_registered = False
_exit_note = ""  # what that line adds while the exit waits for something (an upload)


def note_for_exit(text: str) -> None:
    """What the line of a signal that ends a committed stop's exit adds (``""``: nothing),
    set by what the exit waits for: the handler reads one string, it formats nothing."""
    global _exit_note
    _exit_note = text


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_ignore_while_finalizing)
        _atexit_registered = True


def release_for_exit() -> None:
    """The program is over and the interpreter exits, but something still waits (a bucket's
    upload at exit): put back the handlers that were there before every latch still installed
    in this process (a handler never closed), so that a signal now ends the process as it
    would without preemptible, instead of being recorded for a stop no loop will act on (the
    process went on waiting, and then exited 0). A latch that holds for a committed stop's
    exit is left as it is: it exits at once with the stop's code already."""
    if threading.current_thread() is not threading.main_thread():
        return
    latches = set()
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        latch = getattr(handler, "__self__", None)
        if isinstance(latch, SignalLatch) and latch._owner_pid == os.getpid():
            latches.add(latch)
    for latch in latches:
        if not latch.holding:
            latch.restore()


def _ignore_while_finalizing() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for latch in _holding:
        if latch._owner_pid != os.getpid():
            continue
        for sig in latch._previous:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_IGN)


# --- DataLoader workers ------------------------------------------------------------------
#
# PyTorch's DataLoader workers replace the SIGTERM handler with a C handler that exits
# quietly when the *parent* sent the signal and otherwise dies by it. A SIGTERM to the whole
# process group (kill -TERM -PGID, Kubernetes, SLURM) therefore kills every worker, and the
# main process fails with "DataLoader worker (pid N) is killed by signal: Terminated" before
# it reaches a step boundary. While a latch that covers SIGTERM is installed, each newly
# forked worker instead waits for SIGTERM in a helper thread: from its parent (the normal
# shutdown path of the DataLoader) it exits quietly as before; from anyone else it is left to
# the training process, which stops at the next step boundary and shuts its workers down.

_guarding: list[SignalLatch] = []
_patched = False


def _register_guard(latch: SignalLatch) -> None:
    if signal.SIGTERM in latch.signals:
        _guarding.append(latch)
        patch_dataloader_workers()


def _unregister_guard(latch: SignalLatch) -> None:
    if latch in _guarding:
        _guarding.remove(latch)


def patch_dataloader_workers() -> bool:
    """Hook torch's worker start-up, if torch is imported; True when the hook is in place."""
    global _patched
    if _patched:
        return True
    import sys

    if "torch" not in sys.modules:
        return False
    try:
        from torch.utils.data._utils import signal_handling
    except ImportError:  # pragma: no cover - torch without its data utilities
        return False
    original = getattr(signal_handling, "_set_worker_signal_handlers", None)
    if original is None:  # pragma: no cover - a torch release that moved it
        logger.debug("preemptible: torch has no _set_worker_signal_handlers; workers unguarded")
        return False

    def _set_worker_signal_handlers(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if _guarding:
            shield_worker_from_group_sigterm()
        return result

    signal_handling._set_worker_signal_handlers = _set_worker_signal_handlers  # type: ignore[attr-defined]
    _patched = True
    return True


def shield_worker_from_group_sigterm() -> None:
    """In a worker process: survive a SIGTERM that was not sent by the parent.

    Blocks SIGTERM in this thread (threads started later inherit the mask) and waits for it
    in a daemon thread that can see who sent it.
    """
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait() -> None:
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            if info.si_pid == parent or os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=wait, name="preemptible-sigterm", daemon=True).start()
