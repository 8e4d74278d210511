"""preemptible's log lines: one logger, the rank in every line of a multi-rank run.

Under torch.distributed every rank logs the same events ("received SIGTERM", "stopped at step
N"); two identical lines cannot be told apart, and one "received SIGTERM" does not say which
rank got it. Once a stop session knows its rank in a group of more than one, every line of the
``preemptible`` logger reads ``preemptible: rank N: ...``, and so do the lines written straight
to stderr from a signal handler.
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


if not any(isinstance(f, _RankFilter) for f in logger.filters):
    logger.addFilter(_RankFilter())


def announce(message: str, *args: Any) -> None:
    """An INFO line a person must see even when the program's logging would not show it (no
    handler, or a level above INFO: ``logging.basicConfig()`` alone leaves WARNING)."""
    if logger.hasHandlers() and logger.isEnabledFor(logging.INFO):
        logger.info(message, *args)
    else:
        record = logging.LogRecord("preemptible", logging.INFO, "", 0, message, args, None)
        _RankFilter().filter(record)
        print(record.getMessage(), file=sys.stderr, flush=True)
