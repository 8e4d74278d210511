"""The signal latch: the first signal asks for a stop, the second one exits at once.

Why a latch and not "save in the handler": Python runs a signal handler in the main thread
between two bytecodes, i.e. in the middle of whatever the training step was doing. A
checkpoint taken there mixes half-updated parameters with the optimizer state, and under
torch.distributed a save is a collective that hangs when only one rank got the signal. So
the handler does the least it can -- one log line and an append to a list -- and the
checkpoint is written at the next step boundary by ordinary code.

Forked children (DataLoader workers, user ``multiprocessing`` pools) inherit Python-level
handlers. The handler compares ``os.getpid()`` with the pid that installed it and does
nothing in any other process, so a signal sent to the whole process group neither stops the
run twice nor kills a worker through a stale copy of this object.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from ._termination import Notice

logger = logging.getLogger("preemptible")

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
)

_Handler = Callable[[int, FrameType | None], Any] | int | None


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def normalize_signals(signals: Iterable[int | str] | None) -> tuple[signal.Signals, ...]:
    """Accept signal numbers, ``signal.Signals`` members or names like "TERM" / "SIGTERM"."""
    from ._errors import ConfigError

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
    first signal only; it must be cheap and must not block.
    """

    def __init__(self, signals: Iterable[int], notify: Callable[[Notice], None]) -> None:
        self.signals: tuple[int, ...] = tuple(signals)
        self._notify = notify
        self._owner_pid = os.getpid()
        self._previous: dict[int, _Handler] = {}
        self._received: list[tuple[int, float]] = []

    @property
    def installed(self) -> bool:
        return bool(self._previous)

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
        for sig in self.signals:
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
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
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
        for sig, prev in self._previous.items():
            current = signal.getsignal(sig)
            if current != self._handle:
                # Someone installed a handler over ours; theirs stays, and restoring ours
                # on top of it would break their restore later.
                logger.debug("preemptible: %s handler was replaced; leaving it", signal_name(sig))
                continue
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()
        _unregister_guard(self)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._owner_pid:
            return  # a forked child with an inherited copy of this handler: not ours to act on
        now = time.time()
        self._received.append((signum, now))
        name = signal_name(signum)
        if len(self._received) == 1:
            logger.warning(
                "preemptible: received %s; finishing the current step, then saving a checkpoint "
                "and exiting (send it again to exit at once without saving)",
                name,
            )
            self._notify(Notice(source=name, received_at=now, signum=signum))
        else:
            logger.warning("preemptible: received %s again; exiting now without saving", name)
            os._exit(1)


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
