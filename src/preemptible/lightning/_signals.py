"""The callback and Lightning's own signal handling (its ``_SignalConnector``).

Lightning installs its own SIGTERM handler at the start of every fit (after ``setup``, before
the sanity check) and restores the handlers it found when the fit ends. The callback takes its
signals back the moment Lightning registers (so ``trainer.received_sigterm`` stays False and
no ``SIGTERMException`` is raised), makes Lightning's restore put back what the user had, not
the callback's, and after a committed stop keeps its handler where the one before was
SIG_DFL (a late signal would otherwise kill a process that has saved).

Lightning's connector is private (``trainer._signal_connector``); ``tests/unit/
test_private_api_canary.py`` fails loudly when it moves in the pinned Lightning.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import lightning.pytorch as pl

from ..frontend import SignalLatch, signal_name

logger = logging.getLogger("preemptible")


def _describe(handler: object) -> str:
    module = getattr(handler, "__module__", None) or "?"
    name = getattr(handler, "__qualname__", None) or type(handler).__name__
    return f"{module}.{name}"


def _is_users(handler: object) -> bool:
    """A handler someone installed (not SIG_DFL/SIG_IGN/None, not Python's Ctrl+C default)."""
    return callable(handler) and handler is not signal.default_int_handler


def warn_about_replaced_handlers(latch: SignalLatch) -> None:
    for sig in latch.signals:
        previous = latch.previous(sig)
        if _is_users(previous) and not latch.handles(previous):
            name = signal_name(sig)
            logger.warning(
                "preemptible: the %s handler installed before fit() (%s) is not called "
                "during the fit: the callback handles %s (checkpoint, then exit); it is "
                "put back when the fit ends",
                name,
                _describe(previous),
                name,
            )


class Connector:
    """Lightning's signal connector of one fit, while the callback handles the signals."""

    def __init__(self, trainer: pl.Trainer, latch: SignalLatch) -> None:
        self.trainer = trainer
        self.latch = latch
        self._wrapped: Any = None  # the connector while its method is wrapped

    def wrap_registration(self) -> None:
        """Lightning registers its SIGTERM handler at the start of the fit, after ``setup``
        and before the sanity check; take SIGTERM back the moment it does."""
        connector = getattr(self.trainer, "_signal_connector", None)
        register = getattr(connector, "register_signal_handlers", None)
        if connector is None or not callable(register):
            return  # on_sanity_check_start / on_train_start take it back instead

        def register_then_take_back() -> None:
            register()
            self.take_back()

        connector.register_signal_handlers = register_then_take_back
        self._wrapped = connector

    def unwrap(self) -> None:
        if self._wrapped is not None:
            vars(self._wrapped).pop("register_signal_handlers", None)
            self._wrapped = None

    def take_back(self) -> None:
        """Take our signals (SIGTERM, and the SLURM requeue signal where Lightning set a
        handler for it) back from Lightning, and make Lightning's later restore put back what
        the user had, not ours."""
        latch = self.latch
        if not latch.installed:
            return
        latch.reclaim()
        connector = getattr(self.trainer, "_signal_connector", None)
        originals = getattr(connector, "_original_handlers", None)
        if isinstance(originals, dict):
            for sig, handler in list(originals.items()):
                if latch.handles(handler):
                    originals[sig] = latch.previous(sig)
        if connector is not None and any(s == signal.SIGTERM for s, _ in latch.received):
            connector.received_sigterm = False  # it reached Lightning's handler too: ours

    def keep_for_exit(self) -> None:
        """Lightning restores the handlers it found when the fit ends, also on the way out of
        a stop. Where that is SIG_DFL (a late signal would kill a process that has saved),
        ours stays, holding the exit code; any other handler is put back, so a notebook that
        catches the SystemExit gets its Ctrl+C back."""
        connector = getattr(self.trainer, "_signal_connector", None)
        originals = getattr(connector, "_original_handlers", None)
        if isinstance(originals, dict):
            for sig in self.latch.signals:
                if self.latch.previous(sig) in (signal.SIG_DFL, None):
                    originals.pop(sig, None)
