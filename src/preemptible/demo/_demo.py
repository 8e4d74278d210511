"""The demo's training job: a small classifier, run as ``python -m preemptible.demo._demo``.

Batches come from a per-epoch permutation drawn from a generator seeded by the epoch, so the
data position is a function of the step; dropout and label noise draw from the global RNGs,
which preemptible saves and restores. Prints ``step N`` as each step starts.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time

from ._loop import classifier, fit


def main(argv: list[str] | None = None) -> int:
    import torch

    import preemptible

    p = argparse.ArgumentParser(prog="python -m preemptible.demo._demo")
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-time", type=float, default=0.01)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    random.seed(0)
    torch.set_num_threads(1)
    data_gen = torch.Generator().manual_seed(7)
    n, batch = 1024, 64
    angle = torch.rand(n, generator=data_gen) * 4 * math.pi
    label = torch.randint(0, 2, (n,), generator=data_gen)
    radius = angle / (4 * math.pi)
    sign = label * 2 - 1
    points = torch.stack([sign * radius * torch.cos(angle), sign * radius * torch.sin(angle)], 1)

    model, opt, sched = parts = classifier(64, 3e-3, args.steps)
    handler = preemptible.PreemptionCheckpointHandler(
        args.checkpoint_dir, {"model": model, "optimizer": opt, "scheduler": sched}
    )
    print(f"resumed {handler.resume()}", flush=True)

    def finished(step: int, loss: float) -> None:
        if args.step_time:
            # stands in for a longer step, so a signal lands in the middle of one
            time.sleep(args.step_time * (0.5 + random.random()))

    fit(
        handler.steps(args.steps),
        parts,
        points,
        label,
        batch=batch,
        label_noise=0.02,
        started=lambda step: print(f"step {step}", flush=True),
        finished=finished,
    )
    torch.save(model.state_dict(), args.out)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
