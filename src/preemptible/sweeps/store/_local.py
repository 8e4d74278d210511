"""What an agent can see on its own host about a run's previous holder (the store's ``Local``).

Before a run is taken over or started here, the agent makes sure that nothing of an earlier
attempt still runs on this host: not the process that held the lease (a stopped agent is
alive: SIGSTOP, Ctrl+Z), and no process that holds the run's locks in this agent's home (the
supervisor's ``supervisor.lock``, a training process's checkpoint ``.preemptible.lock``, which
a run orphaned by a killed agent may still hold). Locks are looked up in the kernel's table
(``/proc/locks``), never taken: taking one, even for a moment, could turn away the process
that is starting to hold it. A holder is identified by boot, pid namespace, pid and start
time, so a pid reused by another process, or seen from another container, is not mistaken
for it; a holder on another host is not judged here (the store's margin decides).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..._errors import ConfigError
from ..._files import held_flocks
from ..._paths import LOCK_NAME as SUPERVISOR_LOCK
from ...checkpoint._location import Location, is_url, staging_dir
from ...checkpoint._store import LOCK_NAME as CHECKPOINT_LOCK
from ...notices._lease import boot_id
from ...supervisor._record import load_record
from ...supervisor._runid import check_run_id
from ...supervisor._runs import _is_held

logger = logging.getLogger("preemptible")


def _pid_namespace() -> str:
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return ""
    return "".join(c for c in link if c.isdigit())


def process_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of ``pid``; None if there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def process_identity(pid: int | None = None) -> str:
    """``boot_id/pid_namespace/pid/start_ticks`` of a process (this one by default)."""
    pid = os.getpid() if pid is None else pid
    found = process_stat(pid)
    return f"{boot_id()}/{_pid_namespace()}/{pid}/{found[1] if found else ''}"


def holder_alive(holder: str | None) -> bool | None:
    """Whether the process ``holder`` (``process_identity``) still lives; None when it cannot
    be told from here: another boot or pid namespace (another host, another container), or no
    holder recorded. A zombie is dead: it holds no locks and runs nothing."""
    if not holder:
        return None
    parts = holder.split("/")
    if len(parts) != 4 or not all(parts) or not parts[2].isdigit():
        return None
    boot, namespace, pid, start = parts
    if boot != boot_id() or namespace != _pid_namespace():
        return None
    found = process_stat(int(pid))
    if found is None or found[0] in ("Z", "X"):
        return False
    return str(found[1]) == start


class HostView:
    """The store's ``Local`` for an agent whose run directories are under ``home``."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.identity = process_identity()
        self._said: dict[str, str] = {}  # run id -> the reason last logged for waiting

    def holder_alive(self, holder: str | None) -> bool | None:
        alive = holder_alive(holder)
        if alive:
            pid = (holder or "").split("/")[2]
            found = process_stat(int(pid))
            how = " (stopped)" if found is not None and found[0] in ("T", "t") else ""
            self._wait_for(holder or "", f"its agent, pid {pid} on this host, is alive{how}")
        return alive

    def blocked(self, run_id: str) -> str | None:
        try:
            check_run_id(run_id, "the sweep database")
        except ConfigError:
            return None  # not a directory name: the agent refuses the run before touching it
        run_dir = self.home / "runs" / run_id
        held = held_flocks()  # read afresh: a snapshot could miss a lock just taken
        reason = None
        if _is_held(run_dir / SUPERVISOR_LOCK, held):
            reason = f"a supervisor holds {run_dir / SUPERVISOR_LOCK}{_pid_in(run_dir)}"
        else:
            for directory in _checkpoint_dirs(run_dir):
                if _is_held(directory / CHECKPOINT_LOCK, held):
                    reason = f"a process of an earlier attempt holds {directory / CHECKPOINT_LOCK}"
                    break
        if reason is not None:
            self._wait_for(run_id, reason)
        else:
            self._said.pop(run_id, None)
        return reason

    def locked(self, run_id: str, reason: str) -> None:
        """The run's supervisor lock was refused, by a holder not in this host's lock table
        as this agent sees it (another pid namespace): said once, like ``blocked``'s."""
        self._wait_for(run_id, reason)

    def _wait_for(self, key: str, reason: str) -> None:
        if self._said.get(key) != reason:
            self._said[key] = reason
            logger.info("preemptible: waiting: %s; its run is not started here until then", reason)


def _pid_in(run_dir: Path) -> str:
    try:
        text = (run_dir / SUPERVISOR_LOCK).read_text(encoding="ascii", errors="replace")[:256]
    except OSError:
        return ""
    pid = text.split("\n", 1)[0].strip()  # then its identity (``supervisor/_lock.py``)
    return f" (pid {pid})" if pid.isascii() and pid.isdigit() else ""


def _checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The run's own checkpoint directory, and the one its newest attempt said it saves in (a
    bucket's URL: its staging directory on this host, which that attempt's store locks)."""
    places = [run_dir / "checkpoints"]
    try:
        numbers = [
            int(e.name.split("-", 1)[1])
            for e in os.scandir(run_dir)
            if e.name.startswith("attempt-") and e.name.split("-", 1)[1].isdecimal()
        ]
    except OSError:
        numbers = []
    if numbers:
        where = load_record(run_dir / f"attempt-{max(numbers)}").checkpoint_dir
        if where is not None and is_url(where):
            try:
                location = Location.parse(where)
                if not location.is_local:
                    places.append(staging_dir(location))
            except ConfigError:  # a bad URL, or no staging directory here: nothing to look at
                pass
            return places
        if where is not None and os.path.isabs(where) and Path(where) != places[0]:
            places.append(Path(where))
    return places
