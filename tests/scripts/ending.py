"""Ends in a chosen way, with a chosen run-record mark (for the supervisor's state table).

ending.py MARK END
MARK: none | start (mark_preempting() first) | stopping (record a stop under way, as the
      handler does before it saves)
END:  exit0 | exit3 | sigkill | sigint | sigterm | sigusr1 (death by that signal)
"""

from __future__ import annotations

import os
import signal
import sys

from preemptible import _run, mark_preempting

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line


def main() -> None:
    mark, end = sys.argv[1], sys.argv[2]
    print(f"attempt {os.environ.get('PREEMPTIBLE_ATTEMPT')}", flush=True)
    if mark == "start":
        mark_preempting()
    elif mark == "stopping":
        _run.update_record(state="stopping", preempting=True, step=7, reason="test")
    if end.startswith("exit"):
        sys.exit(int(end[4:]))
    sig = signal.Signals["SIG" + end[3:].upper()]
    if sig != signal.SIGKILL:
        signal.signal(sig, signal.SIG_DFL)  # die by it, not by a Python exception
    os.kill(os.getpid(), sig)
    signal.pause()


if __name__ == "__main__":
    main()
