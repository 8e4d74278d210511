"""One run of the sweep demo: ``python -m preemptible.demo._train --lr=0.01 --hidden=8``.

A small classifier of two noisy rings, trained the way a run of a real sweep is: its
hyperparameters come as W&B-style arguments, its checkpoints go to the directory its
supervisor gives (``PREEMPTIBLE_CHECKPOINT_DIR``), it reports its loss with
``preemptible.report``, and a stop (a signal, the stop file) saves and exits so that the next
attempt resumes it. Batches are a function of the step and dropout draws from the global RNG,
which preemptible saves, so a resumed run ends with the weights of a run never stopped. The
final weights go to ``final.pt`` beside the checkpoint directory.

It prints ``RUN_ID step N`` as each step starts, so whoever watches the output knows which
run is where.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from ._loop import classifier, fit


def main(argv: list[str] | None = None) -> int:
    import torch

    import preemptible

    p = argparse.ArgumentParser(prog="python -m preemptible.demo._train")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.02)
    args = p.parse_args(argv)
    run = preemptible.current_run()
    if run.checkpoint_dir is None:
        p.error("PREEMPTIBLE_CHECKPOINT_DIR is not set; run this under preemptible agent/run")
    name = run.run_id or "-"

    torch.manual_seed(0)
    torch.set_num_threads(1)
    data_gen = torch.Generator().manual_seed(7)
    n, batch = 512, 64  # two noisy rings: label 0 inside, label 1 outside
    label = torch.randint(0, 2, (n,), generator=data_gen)
    angle = torch.rand(n, generator=data_gen) * 2 * math.pi
    radius = 0.5 + 0.5 * label + 0.15 * torch.randn(n, generator=data_gen)
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], 1)

    model, opt, sched = parts = classifier(args.hidden, args.lr, args.steps)
    handler = preemptible.PreemptionCheckpointHandler(
        run.checkpoint_dir, {"model": model, "optimizer": opt, "scheduler": sched}
    )

    def finished(step: int, loss: float) -> None:
        preemptible.report(loss=loss, step=step)
        if args.step_time:
            time.sleep(args.step_time)  # stands in for a longer step

    fit(
        handler.steps(args.steps),
        parts,
        points,
        label,
        batch=batch,
        started=lambda step: print(f"{name} step {step}", flush=True),
        finished=finished,
    )
    model.eval()
    with torch.no_grad():
        final = torch.nn.functional.cross_entropy(model(points), label).item()
    preemptible.report(loss=final, step=args.steps)
    torch.save(model.state_dict(), run.checkpoint_dir.parent / "final.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
