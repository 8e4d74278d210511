"""A sweep program with no handler at all: a plain script, as any ``program:`` of a sweep may be.
It does not import preemptible, watches no lease and dies of the first SIGTERM, so only its
agent's side can stop it in time (the guardian's lease fence, ``supervisor/_guard.py``).

``--log FILE`` appends ``RUN PID MONOTONIC STEP`` for every step (O_APPEND, one write each), as
``lease_train.py`` does: two processes of one run whose steps interleave in time are two
attempts running at once. ``--lr`` is accepted and ignored.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--log", default=None)
    p.add_argument("--lr", type=float, default=0.0)
    args = p.parse_args()
    run = os.environ.get("PREEMPTIBLE_RUN_ID", "-")
    log = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if args.log else None
    for step in range(args.steps):
        if log is not None:
            os.write(log, f"{run} {os.getpid()} {time.monotonic():.4f} {step}\n".encode())
        print(f"step {step}", flush=True)
        time.sleep(args.step_sleep)  # the step's work, not a synchronisation
    return 0


if __name__ == "__main__":
    sys.exit(main())
