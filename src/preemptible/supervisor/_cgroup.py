"""Where an attempt's processes are contained: a cgroup v2 of its own, or the /proc guardian.

A cgroup is the only complete answer: the kernel puts every process the job starts into it,
whatever session or process group it moves to, and ``cgroup.kill`` (Linux >= 5.14) ends them
all at once. It needs a cgroup v2 directory this process may write: as root, or in a subtree
delegated to its user (``systemd-run --user --scope -p Delegate=yes``, a container with a
writable cgroup namespace). Typical places do not offer one: a SLURM step's cgroup belongs to
root (slurmstepd; SLURM then kills the whole step when it ends), a Kubernetes pod mounts
/sys/fs/cgroup read-only, a login session's scope is not delegated. There the guardian
tracks the attempt's processes through /proc (``_guard.Tracker``).

The attempt's cgroup is made under the supervisor's own (``preemptible.RUN_ID.ATTEMPT.PID``).
The job is started *inside* it, with no window in which it could fork outside: the supervisor
moves itself in, starts the job, and moves itself back (cgroup membership is inherited at
fork; a preexec function would be unsafe in the agent, which has threads).

``PREEMPTIBLE_CONTAINMENT=auto|cgroup|proc`` chooses: ``auto`` (the default) takes a cgroup
where one can be made and the guardian elsewhere; ``cgroup`` refuses to start without one;
``proc`` never tries.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .._env import env_choice
from .._errors import ConfigError

CHOICES = ("auto", "cgroup", "proc")
ENV = "PREEMPTIBLE_CONTAINMENT"
PREFIX = "preemptible."


@dataclass(frozen=True)
class Containment:
    """What this supervisor uses, and why, in a sentence for the log and the doctor."""

    kind: str  # "cgroup" or "proc"
    why: str
    parent: Path | None = None  # the cgroup under which attempts get theirs

    def describe(self) -> str:
        if self.kind == "cgroup":
            return f"cgroup v2 per attempt, under {self.parent} ({self.why})"
        return f"/proc guardian ({self.why})"


def _mount() -> tuple[Path, str] | None:
    """The cgroup v2 mount point and the path inside the hierarchy it shows."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if sep and right.split()[:1] == ["cgroup2"] and len(fields) >= 5:
            return Path(fields[4]), fields[3]
    return None


def own_cgroup() -> str | None:
    """This process's cgroup v2 path ("0::/path" in /proc/self/cgroup)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return line[3:]
    except OSError:
        pass
    return None


def _directory() -> tuple[Path | None, str]:
    mount = _mount()
    if mount is None:
        return None, "no cgroup v2 hierarchy is mounted (cgroup v1 only)"
    where, root = mount
    mine = own_cgroup()
    if mine is None:
        return None, "this process is in no cgroup v2"
    if mine.endswith(" (deleted)"):
        return None, f"this process's cgroup {mine} was removed"
    inside = os.path.relpath(mine, root)
    if inside.startswith(".."):
        return None, f"this process's cgroup {mine} is outside the mounted {root}"
    return (where / inside if inside != "." else where), ""


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _why_not(exc: OSError, path: Path) -> str:
    if exc.errno == 30:  # EROFS
        return f"{path} is mounted read-only (a container without a writable cgroup namespace)"
    if exc.errno in (1, 13):  # EPERM, EACCES
        return (
            f"{path} is not writable here: not root, and not a subtree delegated to this user "
            "(a SLURM step, a login session)"
        )
    return f"cannot use {path}: {exc.strerror or exc}"


def probe() -> Containment:
    """Whether this process can contain its attempts in cgroups: make one under its own
    cgroup, move itself in and back out, remove it."""
    here, why = _directory()
    if here is None:
        return Containment("proc", why)
    test = here / f"{PREFIX}probe.{os.getpid()}"
    try:
        test.mkdir()
    except OSError as exc:
        return Containment("proc", _why_not(exc, here))
    try:
        if not (test / "cgroup.kill").exists():  # the root cgroup never has one: look below
            return Containment("proc", f"cgroups under {here} have no cgroup.kill (Linux < 5.14)")
        _write(test / "cgroup.procs", "0")
        _write(here / "cgroup.procs", "0")
    except OSError as exc:
        with contextlib.suppress(OSError):
            _write(here / "cgroup.procs", "0")
        return Containment("proc", _why_not(exc, here / "cgroup.procs"))
    finally:
        with contextlib.suppress(OSError):
            test.rmdir()
    return Containment("cgroup", "this process may create and enter cgroups there", here)


def choose() -> Containment:
    """The containment for this supervisor's attempts, as ``PREEMPTIBLE_CONTAINMENT`` says."""
    wanted = env_choice(ENV, CHOICES) or "auto"
    if wanted == "proc":
        return Containment("proc", f"{ENV}=proc")
    found = probe()
    if wanted == "cgroup" and found.kind != "cgroup":
        raise ConfigError(
            f"{ENV}=cgroup, but no cgroup v2 can be made here: {found.why}; run as root or in a "
            f"delegated subtree, or set {ENV}=auto"
        )
    return found


class AttemptCgroup:
    """One attempt's cgroup: made, entered for the job's start, killed, removed."""

    def __init__(self, parent: Path, name: str) -> None:
        self.parent = parent
        self.path = parent / name
        self.path.mkdir()

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """This process inside the cgroup for the duration: what it starts is born there."""
        _write(self.path / "cgroup.procs", "0")
        try:
            yield
        finally:
            _write(self.parent / "cgroup.procs", "0")

    def procs(self) -> list[int]:
        from ._guard import cgroup_procs

        return cgroup_procs(self.path)

    def kill(self) -> list[int]:
        from ._guard import cgroup_kill

        return cgroup_kill(self.path)

    def remove(self) -> bool:
        from ._guard import cgroup_remove

        return cgroup_remove(self.path)


def remove_stale(parent: Path) -> None:
    """Remove the empty attempt cgroups under ``parent`` whose supervisor (the pid that ends
    their name) is gone: its attempt's processes ended on their own after it was killed. A
    cgroup that still holds a process cannot be removed, and is left for that run's next
    supervisor (``EarlierAttempts``)."""
    from ._guard import cgroup_remove, read_proc

    try:
        names = [e.name for e in os.scandir(parent) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for name in names:
        owner = name.rsplit(".", 1)[-1]
        if not name.startswith(PREFIX) or not owner.isascii() or not owner.isdigit():
            continue
        proc = read_proc(int(owner))
        if proc is None or proc.zombie:
            cgroup_remove(parent / name)


def cgroup_name(run_id: str, attempt: int) -> str:
    return f"{PREFIX}{run_id}.{attempt}.{os.getpid()}"


def attempt_cgroup_of(pid: int, run_id: str) -> Path | None:
    """The cgroup of an attempt of ``run_id`` (by its name) that ``pid`` is in, if any; never
    this process's own cgroup or one above it."""
    mount, mine = _mount(), own_cgroup()
    if mount is None or mine is None:
        return None
    try:
        path = next(
            line[3:]
            for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
            if line.startswith("0::")
        )
    except (OSError, StopIteration):
        return None
    name = re.compile(rf"{re.escape(PREFIX + run_id)}\.[0-9]+\.[0-9]+")
    parts = Path(path).parts
    ours = [i for i, part in enumerate(parts) if name.fullmatch(part)]
    if not ours:
        return None
    found = Path(*parts[: ours[-1] + 1])
    if Path(mine) == found or found in Path(mine).parents:
        return None
    where, root = mount
    relative = os.path.relpath(found, root)
    if relative.startswith(".."):
        return None
    return where / relative
