"""A run that holds still at one moment of its first attempt, so that a test can stop it there.

moments.py --at start|loop|save|end [--steps N] [--tag T]

``start``: before its handler exists (a program importing torch, building a model), it prints
``waiting at start`` and waits; ``loop``: in step 2, ``waiting at loop``, until its handler
has the stop (then the handler saves and exits); ``save``: as ``loop``, and then its stop's
save hangs (``waiting at save``) until the supervisor kills it; ``end``: after its loop, with
the handler closed (writing results, exporting), ``waiting at end``. It holds still only in
attempt 1 (``PREEMPTIBLE_ATTEMPT``), never longer than ``WAIT`` seconds (then it exits 9,
which no test expects), and polls the whole time: a signal finds it in its loop, not in a
blocking call. No torch: it checkpoints one integer through ``save_fn``, as ``lease_train.py``
does, and watches what an agent's run watches.

It prints ``step N`` for each step it trains and ``trained X`` after its loop, where X is the
value of its one integer: a run that resumed exactly ends with the value of a run never
stopped (``lease_train.expected``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line

WAIT = 60.0


def hold(moment: str, until: Callable[[], object] | None = None) -> None:
    """Say ``waiting at MOMENT``, then wait for a stop (or until ``until()`` is true)."""
    # one write: under PYTHONUNBUFFERED print() writes the text and its newline apart, and a
    # supervisor's log line on the same pipe can land between them
    sys.stdout.write(f"waiting at {moment}\n")
    sys.stdout.flush()
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if until is not None and until():
            return
        time.sleep(0.01)
    sys.exit(9)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--at", choices=["start", "loop", "save", "end"], required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tag", default="", help="accepted, so that a grid can make several runs")
    args = p.parse_args()
    first = os.environ.get("PREEMPTIBLE_ATTEMPT") == "1"
    at = args.at if first else None
    if at == "start":
        hold("start")  # before the handler exists: the signal's own default action

    from lease_train import json_handler  # imports preemptible: after the start's hold

    state = {"x": 1}

    def before_save() -> None:
        if at == "save":
            hold("save")  # the stop's save: only the supervisor's SIGKILL ends it

    handler = json_handler(state, before_save)
    for step in handler.steps(args.steps):
        state["x"] = (31 * state["x"] + step) % 1_000_003
        print(f"step {step}", flush=True)
        if step == 2 and at in ("loop", "save"):
            # until the signal is in (the next boundary acts on it), not a lease's warning
            hold("loop", until=lambda: any(n.signum for n in handler.notices))
    print(f"trained {state['x']}", flush=True)
    if at == "end":
        hold("end")  # after the loop: steps() closed the handler
    return 0


if __name__ == "__main__":
    sys.exit(main())
