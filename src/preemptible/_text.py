"""Text for a terminal and for one-line messages: what both the supervisor's and the sweeps'
tables print, and the short repr every error line quotes a bad value with.

In the base layer so that ``preemptible runs`` (the supervisor) and ``preemptible status``
(the sweeps) share it without the supervisor importing the sweeps.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with every character that is not printable (escape sequences, other control
    characters, bidirectional overrides, line separators) as its repr escape: ``\\x1b``."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def format_age(seconds: float | None) -> str:
    """``42s``, ``3m12s``, ``2h05m``, ``3d04h``; ``-`` for none."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def short_repr(value: object, limit: int = 60) -> str:
    """A repr short enough for one line of an error message (repr escapes line breaks); a value
    whose repr fails or is refused (a hostile ``__repr__``, an integer too long to print) is
    named by its type, so the real error is never replaced by another."""
    try:
        shown = repr(value)
    except Exception:
        shown = f"<{type(value).__name__}>"
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."
