"""A training loop without torch, for tests about processes rather than training: it starts
in ~0.5 s where a torch trainer takes seconds on a loaded machine.

The handler saves with a ``save_fn`` (a small file) and otherwise runs as a real trainer does:
the platform's default termination config (its notices, the watch of its supervisor), stop at
a step boundary with a checkpoint and a run record, exit 128+signum. Prints ``resumed N`` after
``resume()`` and ``step N`` when step N starts. Options as W&B passes them (``--steps=N``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import preemptible
from preemptible.notices import default_config

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", default=None, help="default: the supervisor's directory")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-sleep", type=float, default=0.05)
    args = p.parse_args()

    def save_fn(path: Path) -> None:
        path.write_text("light\n")

    config = dataclasses.replace(default_config(), save_fn=save_fn)
    handler = preemptible.PreemptionCheckpointHandler(args.ckpt, termination_config=config)
    print(f"resumed {handler.resume()}", flush=True)
    for step in handler.steps(args.steps):
        print(f"step {step}", flush=True)
        time.sleep(args.step_sleep)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
