"""The sweep agent's lease on a run, watched by the training process itself.

An agent holds each run by a lease in the sweep database and renews it every heartbeat. When
the renewals stop (the database is unreachable, or the agent itself is stopped: SIGSTOP,
Ctrl+Z, a frozen VM, a machine too loaded to schedule it), the run must be gone before
another agent may take the run over, or two attempts would write one checkpoint directory.
The agent cannot be counted on for that (it may be the process that is stopped), so each time
it renews the lease it writes the lease's end into a file, ``PREEMPTIBLE_LEASE_FILE`` (the
attempt's ``lease.json``), and the training process watches that file as one more source of
platform notices: ``warn_s`` seconds before the deadline it gets a stop Notice with that
deadline, and the grace policy trains on, saves and exits in time, as for a spot VM's notice.
A program that does not watch it (a plain script) is stopped by the attempt's guardian, which
reads the same file (``supervisor/_guard.py``, ``Fence``): SIGTERM a moment after the warning,
SIGKILL at the deadline.

Clocks: the agent measures the deadline on CLOCK_MONOTONIC (``time.monotonic``), which every
process of one boot shares and which never steps (a wall clock set back or forward by NTP or
by hand moves nothing here); the file names the boot (``boot_id``). A reader on another boot
(a worker on another node reading a shared directory) uses the deadline on the wall clock
instead. A process that looks only after its deadline passed by more than the margin (it was
frozen with its agent, then thawed) may be looking at a lease that is already another agent's:
it writes nothing more, no checkpoint, and exits at once (143, marked preempting).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._errors import NoticeError
from .._paths import read_bounded
from ..stop._termination import Notice

logger = logging.getLogger("preemptible")

LEASE_FILE_ENV = "PREEMPTIBLE_LEASE_FILE"
LOST_EXIT_CODE = 143  # as for SIGTERM: the attempt was stopped, not failed
_MAX_BYTES = 1 << 14
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This boot's id (Linux); "" where there is none."""
    try:
        return _BOOT_ID.read_text(encoding="ascii").strip()
    except OSError:
        return ""


def write_lease(
    path: Path,
    *,
    run_id: str,
    attempt: int,
    epoch: int,
    deadline: float,
    warn: float,
    margin: float,
) -> None:
    """Write (atomically) that the lease of this attempt ends at ``deadline`` (monotonic):
    the run must be gone by then. ``warn``: seconds before it that the run is told to stop;
    ``margin``: seconds past it after which the run may already belong to someone else."""
    from .._files import write_text_atomic

    left = deadline - time.monotonic()
    doc = {
        "run_id": run_id,
        "attempt": attempt,
        "epoch": epoch,
        "boot_id": boot_id(),
        "deadline_monotonic": deadline,
        "deadline_wall": time.time() + left,
        "warn_s": warn,
        "margin_s": margin,
    }
    write_text_atomic(path, json.dumps(doc) + "\n")


def _number(doc: dict[str, Any], key: str) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise NoticeError(f"{key} is {value!r}, not a number")
    return float(value)


def _lost(detail: str) -> None:
    """The default for a lease found long past its end: nothing more may be written."""
    from .. import _run

    logger.error(
        "preemptible: %s; another agent may hold the run by now: exiting at once without a "
        "checkpoint (the newest committed one stays)",
        detail,
    )
    _run.update_record(preempting=True, lease_lost=True)
    os._exit(LOST_EXIT_CODE)  # not sys.exit: no finally block, no atexit save may run


class LeaseFile:
    """``PREEMPTIBLE_LEASE_FILE``: a stop Notice with the lease's deadline ``warn_s`` before
    it (module docstring). A missing file is no notice (the agent writes it before the run
    starts; a run started by hand with the variable set has none); a garbled one a NoticeError."""

    name = "lease"

    def __init__(self, path: str | os.PathLike[str], on_lost: Callable[[str], None] = _lost):
        self.path = Path(path)
        self.display = str(self.path)
        self._on_lost = on_lost
        self._boot = boot_id()
        self._polled_at: float | None = None

    def remaining(self) -> tuple[float, dict[str, Any]] | None:
        """Seconds until the lease's deadline (negative: past), and the file; None without one."""
        try:
            doc = json.loads(read_bounded(self.path, _MAX_BYTES)[:_MAX_BYTES])
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError, RecursionError) as exc:
            raise NoticeError(f"{self.display} is not a lease file ({exc})") from exc
        if not isinstance(doc, dict):
            raise NoticeError(f"{self.display} is not a lease file")
        if doc.get("boot_id") and doc.get("boot_id") == self._boot:
            left = _number(doc, "deadline_monotonic") - time.monotonic()
        else:  # written on another boot: only the wall clocks can be compared
            left = _number(doc, "deadline_wall") - time.time()
        return left, doc

    def poll(self) -> Notice | None:
        found = self.remaining()
        if found is None:
            return None
        left, doc = found
        warn, margin = _number(doc, "warn_s"), _number(doc, "margin_s")
        now = time.monotonic()
        gap = 1.0 if self._polled_at is None else now - self._polled_at
        self._polled_at = now
        if left > max(warn, gap):  # else the next look would come after the deadline
            return None
        run = str(doc.get("run_id", "?"))[:128]
        if left < -margin:
            self._on_lost(
                f"the agent's lease on run {run} ended {-left:.1f} s ago and was not renewed "
                "(this process was stopped or frozen)"
            )
            return None
        return Notice(
            source="lease",
            deadline=time.time() + left,
            detail=f"the agent's lease on run {run} was not renewed; the run must be gone in "
            f"{max(left, 0.0):.1f} s, before another agent may take it over",
        )
