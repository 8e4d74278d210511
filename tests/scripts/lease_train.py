"""A fast sweep run for the lease tests and the chaos benchmark: no torch, so it starts in a
fraction of a second and a test's time is spent on what it tests.

Its "model" is one integer, ``x = (31 * x + step) % P`` per step: a resumed run ends with the
same ``x`` as a run never stopped only if it resumed exactly where it stopped (bit for bit).
It checkpoints with ``PreemptionCheckpointHandler`` through ``save_fn`` on top of the platform's
default configuration (``dataclasses.replace(default_config(), save_fn=...)``), so that it
watches what an agent's run watches: signals, and the agent's lease (``lease.json``).

``--lr`` is accepted and ignored (grids vary it); ``--fail`` exits 3 after the first step.
``--log FILE`` appends ``RUN PID MONOTONIC STEP`` for every step (O_APPEND, one write each):
two processes of one run whose steps interleave in time are two attempts running at once.
At the end it writes ``final.json`` (``{"x": ...}``) beside the run's checkpoint directory (in
the run's directory when the checkpoints are in a bucket).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import preemptible
from preemptible.notices import default_config

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line

PRIME = 1_000_003


def expected(steps: int) -> int:
    x = 1
    for step in range(steps):
        x = (31 * x + step) % PRIME
    return x


def json_handler(
    state: dict[str, Any], before_save: Callable[[], None] | None = None
) -> preemptible.PreemptionCheckpointHandler:
    """A handler that checkpoints ``state`` as JSON through ``save_fn``, on top of the
    platform's default configuration, resumed into ``state`` (this script's, ``moments.py``'s
    and ``hyperband_train.py``'s). ``before_save`` runs as each save begins."""

    def save(path: Path) -> None:
        if before_save is not None:
            before_save()
        path.write_text(json.dumps(state))

    config = dataclasses.replace(default_config(), save_fn=save)
    handler = preemptible.PreemptionCheckpointHandler(None, termination_config=config)
    handler.resume()
    if handler.resume_path is not None:
        state.update(json.loads(Path(handler.resume_path).read_text()))
    return handler


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--log", default=None)
    p.add_argument("--lr", type=float, default=0.0, help="accepted, so that a grid can vary it")
    p.add_argument("--fail", action="store_true", help="exit 3 after the first step")
    args = p.parse_args()
    state = {"x": 1}
    handler = json_handler(state)
    run = os.environ.get("PREEMPTIBLE_RUN_ID", "-")
    log = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if args.log else None
    for step in handler.steps(args.steps):
        state["x"] = (31 * state["x"] + step) % PRIME
        if log is not None:
            os.write(log, f"{run} {os.getpid()} {time.monotonic():.4f} {step}\n".encode())
        print(f"step {step}", flush=True)
        preemptible.report(x=state["x"], step=step)
        if args.fail:
            return 3
        if args.step_sleep:
            time.sleep(args.step_sleep)  # the step's work, not a synchronisation
    where = os.environ["PREEMPTIBLE_CHECKPOINT_DIR"]
    beside = (
        Path(os.environ["PREEMPTIBLE_RUN_DIR"]).parent if "://" in where else Path(where).parent
    )
    final = beside / "final.json"
    final.write_text(json.dumps(state))
    return 0


if __name__ == "__main__":
    sys.exit(main())
