"""A small training program for the sweep tests: one run of a sweep.

Takes its hyperparameters as ``--lr=0.1 --steps=N`` (W&B's ``${args}``), checkpoints with
``PreemptionCheckpointHandler`` in the directory the agent gives (``PREEMPTIBLE_CHECKPOINT_DIR``),
reports its loss with ``preemptible.report``, and writes its final weights next to the run's
checkpoints (``final.pt``), so a test can compare a resumed run with an uninterrupted one.
``--step-sleep`` slows steps down so that a test can stop a run in the middle.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

import preemptible


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--fail", action="store_true", help="exit 3 after the first step")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    handler = preemptible.PreemptionCheckpointHandler(None, {"model": model, "optimizer": opt})
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    y = x.sum(1, keepdim=True)
    for step in handler.steps(args.steps):
        print(f"step {step}", flush=True)
        idx = torch.randint(0, 64, (16,))
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        preemptible.report(loss=loss.item(), step=step)
        if args.fail:
            return 3
        if args.step_sleep:
            import time

            time.sleep(args.step_sleep)
    final = Path(os.environ["PREEMPTIBLE_CHECKPOINT_DIR"]).parent / "final.pt"
    torch.save(model.state_dict(), final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
