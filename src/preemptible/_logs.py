"""preemptible's log lines: one logger, the rank in every line of a multi-rank run.

Under torch.distributed every rank logs the same events ("received SIGTERM", "stopped at step
N"); two identical lines cannot be told apart, and one "received SIGTERM" does not say which
rank got it. Once a stop session knows its rank in a group of more than one, every line of the
``preemptible`` logger reads ``preemptible: rank N: ...``, and so do the lines written straight
to stderr from a signal handler.

Every line of a stop reads the same, whatever logging a framework set up behind the program's
back. absl (TensorFlow's checkpoint writer logs through it) calls ``logging.basicConfig()``
the first time it logs when the root logger has no handler, so a TensorFlow process that saved
once has a root handler with the ``WARNING:name:message`` format: preemptible's warnings came
out as ``WARNING:preemptible:preemptible: ...`` while its INFO lines, below that root's level,
were written as ``preemptible: ...``. A root logger configured so, and nothing else, is taken
for what it is, logging nobody configured: preemptible's lines then go to stderr as they would
with no handler at all, one format. A program that configured its own handlers (any other
format, level or destination) gets every line through them.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

logger = logging.getLogger("preemptible")

PREFIX = "preemptible: "
_rank = ""  # "rank N: " in a process of a multi-rank run


def set_rank(rank: int | None) -> None:
    """Name ``rank`` in every line from now on (None: name none)."""
    global _rank
    _rank = "" if rank is None else f"rank {rank}: "


def prefix() -> str:
    """The start of a line written without the logger (from a signal handler)."""
    return PREFIX + _rank


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if _rank and isinstance(msg, str):
            # after the first "preemptible: ", also when a record factory put something first
            at = msg.find(PREFIX, 0, 200)
            if at >= 0 and not msg.startswith(_rank, at + len(PREFIX)):
                cut = at + len(PREFIX)
                record.msg = msg[:cut] + _rank + msg[cut:]
        return True


def _unconfigured() -> bool:
    """Whether the only handler preemptible's lines reach is the one a bare
    ``logging.basicConfig()`` installs (absl's, when it first logs): stderr, the basic format,
    the root at WARNING."""
    if logger.handlers or logger.level != logging.NOTSET:
        return False
    root = logging.getLogger()
    if len(root.handlers) != 1 or root.level != logging.WARNING:
        return False
    [handler] = root.handlers
    formatter = handler.formatter
    return (
        type(handler) is logging.StreamHandler
        and getattr(handler, "stream", None) is sys.stderr
        and handler.level == logging.NOTSET
        and not handler.filters
        and (formatter is None or getattr(formatter, "_fmt", None) == logging.BASIC_FORMAT)
    )


class _OneFormat(logging.Filter):
    """Under logging nobody configured, a line goes to stderr as it is (see the docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _unconfigured():
            return True
        print(_PLAIN.format(record), file=sys.stderr, flush=True)
        return False


_PLAIN = logging.Formatter("%(message)s")

if not any(isinstance(f, _RankFilter) for f in logger.filters):
    logger.addFilter(_RankFilter())
if not any(isinstance(f, _OneFormat) for f in logger.filters):
    logger.addFilter(_OneFormat())  # after the rank's: it writes the line


def announce(message: str, *args: Any) -> None:
    """An INFO line a person must see even when the program's logging would not show it (no
    handler, or a level above INFO: ``logging.basicConfig()`` alone leaves WARNING)."""
    if logger.hasHandlers() and logger.isEnabledFor(logging.INFO):
        logger.info(message, *args)
    else:
        record = logging.LogRecord("preemptible", logging.INFO, "", 0, message, args, None)
        _RankFilter().filter(record)
        print(record.getMessage(), file=sys.stderr, flush=True)
