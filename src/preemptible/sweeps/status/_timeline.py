"""The timeline of ``preemptible status --plot``, drawn with matplotlib from a document of
``_snapshot``: a bar per attempt, coloured by how it ended, and a marker per preemption."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._errors import ConfigError
from ..._states import Ending

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Bar colours of the timeline by how the attempt ended (None: still running).
ENDING_COLOURS: dict[str | None, str] = {
    Ending.FINISHED: "#2ca02c",
    Ending.PREEMPTED: "#ffbf00",
    Ending.CRASHED: "#ff7f0e",
    Ending.FAILED: "#d62728",
    Ending.KILLED: "#8c1c13",
    Ending.CANCELLED: "#7f7f7f",
    Ending.STOPPED: "#e377c2",
    Ending.RELEASED: "#c7c7c7",
    None: "#1f77b4",
}
PLOT_INSTALL = "pip install 'preemptible[plot]'"
_MAX_LABELS = 50  # the timeline labels at most this many runs on its y axis


def plot_timeline(doc: Mapping[str, Any], path: Path) -> Path:
    """Draw the runs' attempts over time into ``path`` (PNG, or any format matplotlib writes,
    by its suffix); written to a temporary file and renamed, so a reader never sees half."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"plot file {str(path)!r}: directory {str(parent)!r} does not exist")
    if path.is_dir():
        raise ConfigError(f"plot file {str(path)!r} is a directory; give a file such as out.png")
    figure = timeline_figure(doc)
    formats = sorted(figure.canvas.get_supported_filetypes())
    kind = path.suffix[1:].lower()
    if kind not in formats:
        raise ConfigError(
            f"plot file {str(path)!r}: cannot write {path.suffix or 'files without a suffix'!r}; "
            f"use a suffix among {', '.join('.' + f for f in formats)}"
        )
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temp, "wb") as out:
            figure.savefig(out, format=kind)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            temp.unlink()
        if isinstance(exc, OSError):
            reason = exc.strerror or str(exc)
            raise ConfigError(f"plot file {str(path)!r}: cannot write: {reason}") from None
        raise
    return path


def timeline_figure(doc: Mapping[str, Any]) -> Figure:
    """The timeline as a matplotlib Figure (Agg canvas, no display). The bars are one
    collection (gid ``attempts``), a box per attempt in the document's order (runs by index,
    attempts by number); the preemption markers are another (gid ``preemptions``)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.collections import PolyCollection
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError(f"the timeline plot needs matplotlib; {PLOT_INSTALL}") from None

    sweep = doc["sweep"]
    runs = sorted(doc["runs"], key=lambda r: r["index"])
    starts = [a["started_at"] for r in runs for a in r["attempt_log"]]
    origin = min(starts) if starts else float(sweep["created_at"])
    ends = [a["started_at"] + a["duration"] - origin for r in runs for a in r["attempt_log"]]
    span = max(ends, default=0.0)
    unit, scale = ("h", 3600.0) if span > 7200 else ("min", 60.0) if span > 120 else ("s", 1.0)

    height = min(40.0, 1.6 + 0.3 * max(len(runs), 3))
    figure = Figure(figsize=(10.0, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    boxes: list[list[tuple[float, float]]] = []
    colours: list[str] = []
    seen: list[str | None] = []
    marks_x: list[float] = []
    marks_y: list[int] = []
    for y, run in enumerate(runs):
        for a in run["attempt_log"]:
            ending = a["ending"]
            x0 = (a["started_at"] - origin) / scale
            x1 = x0 + a["duration"] / scale
            boxes.append([(x0, y - 0.3), (x0, y + 0.3), (x1, y + 0.3), (x1, y - 0.3)])
            colours.append(ENDING_COLOURS.get(ending, "#9467bd"))
            if ending not in seen:
                seen.append(ending)
            if ending == Ending.PREEMPTED or a.get("lost"):
                marks_x.append(x1)
                marks_y.append(y)
    # one collection for all bars: an artist per bar takes seconds for a sweep of 1000 runs
    bars = PolyCollection(
        boxes, facecolors=colours, edgecolors="black", linewidths=0.5, gid="attempts"
    )
    ax.add_collection(bars)
    ax.scatter(marks_x, marks_y, marker="v", s=40, color="black", zorder=3, gid="preemptions")

    step = max(1, math.ceil(len(runs) / _MAX_LABELS))
    ax.set_yticks(range(0, len(runs), step))
    ax.set_yticklabels([runs[i]["run_id"] for i in range(0, len(runs), step)])
    ax.set_ylim(len(runs) - 0.5 if runs else 0.5, -0.5)  # run 0 at the top
    ax.set_xlim(left=0.0, right=max(span / scale, 1.0) * 1.02)
    ax.set_xlabel(f"time since the first attempt ({unit})")
    ax.set_ylabel("run")
    ax.grid(axis="x", alpha=0.3)
    title = f"sweep {sweep['id']}" + (f" ({sweep['name']})" if sweep.get("name") else "")
    ax.set_title(title)
    if not runs or not starts:
        ax.text(0.5, 0.5, "no attempts yet", transform=ax.transAxes, ha="center", va="center")
    order = [e for e in ENDING_COLOURS if e in seen] + [e for e in seen if e not in ENDING_COLOURS]
    handles: list[Any] = [
        Patch(color=ENDING_COLOURS.get(e, "#9467bd"), label=e or "still running") for e in order
    ]
    if marks_x:
        handles.append(
            Line2D([], [], marker="v", color="black", linestyle="none", label="preemption")
        )
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return figure
