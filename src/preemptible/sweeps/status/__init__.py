"""``preemptible status``: the sweep read from the queue as JSON documents, drawn as tables and a
timeline."""

from __future__ import annotations

from ._render import UNREADABLE, _header_line, format_params, render
from ._snapshot import (
    STATES,
    _encode,
    _metric_of,
    _object,
    _run_docs,
    _Warnings,
    snapshot,
    sweep_head,
)
from ._status import show_status
from ._timeline import ENDING_COLOURS, plot_timeline, timeline_figure

__all__ = [
    "ENDING_COLOURS",
    "STATES",
    "UNREADABLE",
    "_Warnings",
    "_encode",
    "_header_line",
    "_metric_of",
    "_object",
    "_run_docs",
    "format_params",
    "plot_timeline",
    "render",
    "show_status",
    "snapshot",
    "sweep_head",
    "timeline_figure",
]
