"""Whether the process that started this one passes a stop signal on.

A stop signal is usually sent to one process: the one a platform started (a container's PID 1,
a pod's main process), or the one a person or a script names (``kill PID``). When that is a
launcher and training runs in its child, the child hears of the stop only if the launcher
passes the signal on. What was seen on real processes (tests/integration/test_launchers.py):

- ``torchrun`` (and ``accelerate launch --multi_gpu``, which runs torch's elastic agent in its
  own process) sends the signal on to every worker, then exits 1 with a traceback.
- ``accelerate launch`` without ``--multi_gpu`` (``--cpu`` with any ``--num_processes``, or one
  process) uses its "simple launcher": ``subprocess.Popen`` and ``wait``, nothing else. SIGTERM
  ends the launcher at once (143) and the trainer goes on as an orphan, to the end, without a
  stop checkpoint; a shell or a scheduler sees 143, which reads as "checkpoint committed".
- A shell that runs the program as one of several commands (``sh -c "python train.py; ..."``)
  waits for it and does not pass a signal on either; a shell that is a container's PID 1 gets
  ``docker stop``'s and Kubernetes' SIGTERM, and the program never does.

``preemptible run -- LAUNCHER ...`` signals the job's whole process group, so training gets the
signal whatever the launcher does. Only what can be told for sure is reported: the parent's
command line (``/proc``) and torch's elastic agent's environment (``TORCHELASTIC_RUN_ID``,
which every worker of torchrun and of accelerate's multi-process launcher has).

torch's elastic agent also ends what it passed a stop on to: it SIGKILLs its workers its
shutdown timeout after (``--shutdown-timeout``, ``PET_SHUTDOWN_TIMEOUT``,
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30 s), whatever a supervisor above it allows.
``elastic_kill_after`` is that time, so that a worker's stop stops waiting for its upload before
the kill and says what reached the bucket, rather than dying in the wait without a word.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("preemptible")

SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ash", "ksh"})
_ELASTIC_ENV = "TORCHELASTIC_RUN_ID"  # set by torch's elastic agent for its workers
ELASTIC_SHUTDOWN_DEFAULT = 30.0  # torch's own, when nothing sets it
_said = False


@dataclass(frozen=True)
class Launcher:
    """The parent process, which does not pass a stop signal on to this one."""

    pid: int
    name: str  # what it is, for a person: "accelerate launch", "sh (PID 1)"
    why: str  # what happens to a signal sent to it


def unforwarding_parent(*, supervised: bool) -> Launcher | None:
    """The parent of this process when it is known not to pass a stop signal on, and nothing
    passes it on in its place (``preemptible run`` signals the whole group); else None."""
    if supervised:  # under `preemptible run`, which signals the whole group
        return None
    ppid = os.getppid()
    argv = _cmdline(ppid)
    if argv is None:
        return None
    if _is_accelerate_launch(argv) and not os.environ.get(_ELASTIC_ENV):
        return Launcher(
            ppid,
            "accelerate launch",
            "its simple launcher (no --multi_gpu; --cpu with any --num_processes) ends on "
            "SIGTERM without passing it on, and training goes on without a stop checkpoint",
        )
    if ppid == 1 and _comm(1) in SHELLS:
        return Launcher(
            ppid,
            f"{_comm(1)} (PID 1)",
            "a shell as a container's PID 1 does not pass docker stop's or Kubernetes' SIGTERM on",
        )
    return None


def warn_if_unforwarded(*, supervised: bool) -> None:
    """A one-line warning, once per process, when the parent will not pass a stop on."""
    global _said
    if _said:
        return
    _said = True
    try:
        found = unforwarding_parent(supervised=supervised)
    except Exception:  # a look at /proc must never keep training from starting
        return
    if found is not None:
        logger.warning(
            "preemptible: started by %s (pid %d): %s; run it under `preemptible run -- ...`, "
            "which signals the whole process group",
            found.name,
            found.pid,
            found.why,
        )


def elastic_kill_after() -> float | None:
    """Seconds from a stop that torch's elastic agent passed on to this worker to its SIGKILL
    of the worker; None when this process is not such a worker. Read as the agent reads it:
    its command line's ``--shutdown-timeout`` (``/proc`` of the parent, the agent), else
    ``PET_SHUTDOWN_TIMEOUT``, else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30; a value that
    is not a number of seconds counts as the default."""
    if not os.environ.get(_ELASTIC_ENV):
        return None
    given: str | None = None
    argv = _cmdline(os.getppid()) or []
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        name, eq, inline = arg.partition("=")
        if name in ("--shutdown-timeout", "--shutdown_timeout"):
            given = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    value = (
        given
        or os.environ.get("PET_SHUTDOWN_TIMEOUT")
        or os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    )
    try:
        seconds = float(value) if value is not None else ELASTIC_SHUTDOWN_DEFAULT
    except ValueError:
        return ELASTIC_SHUTDOWN_DEFAULT
    return seconds if seconds >= 0 else ELASTIC_SHUTDOWN_DEFAULT


def _is_accelerate_launch(argv: list[str]) -> bool:
    """``accelerate launch ...``, ``accelerate-launch ...`` or ``python -m
    accelerate.commands.launch ...``: the program run, after its interpreter if any."""
    if argv and Path(argv[0]).name.startswith("python"):
        argv = argv[1:]  # the console script's interpreter
    if not argv:
        return False
    program = Path(argv[0]).name
    if program == "accelerate-launch":
        return True
    if program == "accelerate":
        return argv[1:2] == ["launch"]
    if argv[0] == "-m" and len(argv) > 1:
        module, rest = argv[1], argv[2:3]
        cli = module in ("accelerate", "accelerate.commands.accelerate_cli")
        return module == "accelerate.commands.launch" or (cli and rest == ["launch"])
    return False


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
