"""What ``preemptible status`` shows: the sweep read from the queue as JSON data, then drawn.

The reading is ``_snapshot`` (the documents, and ``--json``), the tables are ``_render``
(rich), the timeline is ``_timeline`` (matplotlib); here is the command (``show_status``) and
its ``--watch`` loop. The names other modules import from here stay importable from here.
"""

from __future__ import annotations

import contextlib
import json
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from rich.console import Group, RenderableType
from rich.text import Text

from ..._env import env_float
from ..._errors import ConfigError, PreemptibleError
from ..._text import printable
from ..store._connector import DEFAULT_RETRY_TIMEOUT
from ..store._queue import open_store
from ._render import render, render_sweeps
from ._snapshot import MAX_ROWS, _dump, snapshot, sweeps_snapshot, table_snapshot, write_json
from ._timeline import plot_timeline


# -- --watch ----------------------------------------------------------------------------------
def watch(
    look: Callable[[], RenderableType],
    interval: float,
    show: Callable[[RenderableType], None],
    *,
    stale_after: float | None = None,
    rounds: int | None = None,
) -> None:
    """Show ``look()`` every ``interval`` seconds (``rounds`` times; None: until Ctrl+C).

    ``look`` runs in a thread of its own, one at a time, so that a database that fails
    (``look`` raises a PreemptibleError) or stops answering (no result within ``stale_after``
    seconds) never leaves an old table on the screen as if it were current: the last table
    is shown under a line "database unreachable since HH:MM:SS, showing the last table (of
    HH:MM:SS)", with the reason when known, until a look succeeds again."""
    stale_after = max(5.0, 2.0 * interval) if stale_after is None else stale_after
    results: queue.Queue[tuple[bool, Any]] = queue.Queue()
    view: RenderableType | None = None
    view_at: float | None = None
    down_since: float | None = None
    reason: str | None = None

    def work() -> None:
        try:
            results.put((True, look()))
        except BaseException as exc:  # a bug too: raised again in the caller's thread
            results.put((False, exc))

    def frame() -> RenderableType:
        if down_since is None:
            assert view is not None
            return view
        marker = Text(f"database unreachable since {_clock(down_since)}, ", style="bold red")
        if view is None:
            marker.append("no table read yet", style="bold red")
        else:
            marker.append(f"showing the last table (of {_clock(view_at)})", style="bold red")
        lines: list[RenderableType] = [marker]
        if reason:
            lines.append(Text(printable(reason), style="dim"))
        if view is not None:
            lines.append(view)
        return Group(*lines)

    done = 0
    while rounds is None or done < rounds:
        started = time.time()
        threading.Thread(target=work, name="preemptible-status", daemon=True).start()
        while True:
            try:
                ok, value = results.get(timeout=stale_after if down_since is None else interval)
                break
            except queue.Empty:
                if down_since is None:
                    down_since, reason = started, f"no answer for {stale_after:g} s"
                    show(frame())
        if ok:
            view, view_at, down_since, reason = value, time.time(), None, None
        elif isinstance(value, PreemptibleError):
            down_since = started if down_since is None else down_since
            reason = str(value)
        else:
            raise value
        show(frame())
        done += 1
        if rounds is None or done < rounds:
            time.sleep(interval)


def _clock(at: float | None) -> str:
    return "-" if at is None else time.strftime("%H:%M:%S", time.localtime(at))


# -- the command ------------------------------------------------------------------------------
def show_status(
    db: str | None,
    sweep_id: str | None,
    *,
    as_json: bool = False,
    watch_every: float | None = None,
    plot: Path | None = None,
    out: IO[str] | None = None,
) -> None:
    """``preemptible status``: the sweeps in the database, or one sweep's runs, as a table
    (``watch_every`` seconds: refreshed until Ctrl+C), as JSON, or drawn (``plot``). The
    database is only read (``open_store(reader=True)``)."""
    from rich.console import Console

    if sweep_id is None and plot is not None:
        raise ConfigError("--plot needs a SWEEP_ID")
    out = sys.stdout if out is None else out
    # into a pipe or a file rich would assume 80 columns and squeeze the parameters away
    console = Console(file=out, width=None if out.isatty() else 200)
    retry = None
    if watch_every is not None:  # a failing refresh is shown at once, and tried again
        configured = env_float("PREEMPTIBLE_DB_RETRY_TIMEOUT", DEFAULT_RETRY_TIMEOUT)
        retry = min(configured if configured is not None else DEFAULT_RETRY_TIMEOUT, 2.0)
    store = open_store(db, reader=True, retry_timeout=retry)
    busy = False  # a --watch refresh may still be running in its thread at Ctrl+C
    try:
        if sweep_id is None:
            if as_json:
                out.write(json.dumps(sweeps_snapshot(store), indent=1) + "\n")
                return

            def look() -> RenderableType:
                return render_sweeps(sweeps_snapshot(store), width=console.width)

        else:
            if plot is not None:
                doc = snapshot(store, sweep_id)
                plot_timeline(doc, plot)
                print(f"timeline: {plot}", file=sys.stderr)
                if as_json:
                    _dump(doc["sweep"], doc["runs"], out)
                    return
            elif as_json:
                write_json(store, sweep_id, out)
                return
            limit = MAX_ROWS
            if watch_every is not None and out.isatty():  # what fits under the header
                limit = max(10, console.height - 8)

            def look() -> RenderableType:
                doc = table_snapshot(store, sweep_id, limit=limit)
                return render(doc, width=console.width)

        if watch_every is None:
            console.print(look())
            return
        from rich.live import Live

        with Live(console=console, auto_refresh=False) as live:
            busy = True

            def show(view: RenderableType) -> None:
                live.update(view, refresh=True)

            with contextlib.suppress(KeyboardInterrupt):
                watch(look, watch_every, show)
    finally:
        if not busy:
            store.close()
