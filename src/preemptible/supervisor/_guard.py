"""The guardian: kills an attempt's processes if its supervisor dies without saying goodbye.

Run as ``python -m preemptible.supervisor._guard PGID`` with a pipe from the supervisor as
standard input, in a session of its own (so a signal to the supervisor's process group, or
``kill -9`` of the supervisor, does not reach it). The supervisor writes ``+N`` lines for
process groups the job started outside its own (daemons that called ``setsid()``), and
``done`` when the attempt is over. When the supervisor exits for any reason, SIGKILL
included, the kernel closes the pipe; reading EOF without ``done`` first means the supervisor
is gone, and the guardian SIGKILLs the job's group and every group it was told about, so that
no training process outlives its supervisor. A parent-death signal alone would not do: it
reaches the direct child only, not a training process under ``bash -c`` or ``torchrun``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys


def main() -> int:
    pgids = [int(sys.argv[1])]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    data = b""
    while True:
        chunk = os.read(0, 4096)
        if not chunk:
            break
        data += chunk
    lines = data.decode("ascii", "replace").split("\n")
    if "done" in lines:
        return 0
    pgids += [int(line[1:]) for line in lines if line[:1] == "+" and line[1:].isdigit()]
    for pgid in pgids:
        if pgid > 1:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
