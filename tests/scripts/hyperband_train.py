"""A CPU-cheap sweep run for the Hyperband test: no torch, it starts in a fraction of a second.

Its "model" is a float weight and a seeded ``random.Random``: per step the weight moves by a
draw, and the run reports ``loss = quality / (step + 1) + tiny noise`` at that step, so runs
of a larger ``--quality`` are worse at every step and Hyperband stops them. Its state (the
weight and the generator's state) is checkpointed with ``PreemptionCheckpointHandler``
through ``save_fn``: a run stopped early and resumed ends with the state of a run never
stopped only if it resumed exactly where it stopped. At the end it writes ``final.json``
beside the run's checkpoint directory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import preemptible

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line


def step_state(state: dict[str, Any], step: int, quality: float) -> float:
    """One step: the new state (in place) and the loss reported at it."""
    rng = random.Random()
    rng.setstate(_tupled(state["rng"]))
    state["w"] = state["w"] * 0.9 + rng.gauss(0.0, 1.0)
    state["rng"] = rng.getstate()
    return quality / (step + 1) + 1e-6 * abs(state["w"])


def fresh(seed: int) -> dict[str, Any]:
    return {"w": 0.0, "rng": random.Random(seed).getstate()}


def uninterrupted(quality: float, steps: int, seed: int) -> dict[str, Any]:
    """The state a run never stopped ends with, as JSON reads it back."""
    state = fresh(seed)
    for step in range(steps):
        step_state(state, step, quality)
    return json.loads(json.dumps(state))


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, (list, tuple)) else value


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quality", type=float, required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    from lease_train import json_handler  # a sibling: this file is run as a script

    state = fresh(args.seed)
    handler = json_handler(state)
    for step in handler.steps(args.steps):
        loss = step_state(state, step, args.quality)
        print(f"step {step}", flush=True)
        preemptible.report(loss=loss, step=step)
        if args.step_sleep:
            time.sleep(args.step_sleep)  # the step's work, not a synchronisation
    final = Path(os.environ["PREEMPTIBLE_CHECKPOINT_DIR"]).parent / "final.json"
    final.write_text(json.dumps(state))
    return 0


if __name__ == "__main__":
    sys.exit(main())
