"""A small real training job used by the integration tests (run as a subprocess).

Every step draws from the global RNGs of random, NumPy and torch (batch indices, noise,
dropout), so a resume is exact only if all of them are restored. It prints ``step N`` (flushed)
when step N starts, so a test can send a signal while a chosen step is running.
"""

from __future__ import annotations

import argparse
import atexit
import random
import sys
import time

import numpy as np
import torch

import preemptible

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line


class SlowState:
    """Makes every save take a while, so a test can act while a save is running."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def state_dict(self) -> dict[str, float]:
        say("saving")
        time.sleep(self.seconds)
        return {"seconds": self.seconds}

    def load_state_dict(self, state: dict[str, float]) -> None:
        pass


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", required=True)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--save-every", type=int, default=None)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--grace", type=float, default=None)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--slow-save", type=float, default=0.0, help="seconds each save takes")
    p.add_argument(
        "--linger",
        type=float,
        default=0.0,
        help="seconds spent on the way out (in a finally block, then in atexit), as a slow "
        "interpreter shutdown would",
    )
    p.add_argument("--async-save", action="store_true", help="periodic saves in the background")
    p.add_argument(
        "--slow-write", type=float, default=0.0, help="seconds each checkpoint write takes"
    )
    args = p.parse_args()
    if args.slow_write:
        _slow_down_writes(args.slow_write)
    if args.linger:
        atexit.register(_linger, "atexit", args.linger)
        try:
            return train(args)
        finally:
            _linger("finally", args.linger)
    return train(args)


def say(line: str) -> None:
    """One write per line: the background writer prints too, and print() writes the text and
    the newline separately, so two threads' lines could run together."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _slow_down_writes(seconds: float) -> None:
    """Every checkpoint write (in whichever thread writes it) takes ``seconds`` longer."""
    import preemptible.checkpoint._savers as one_process
    import preemptible.distributed._savers as ranks

    write = one_process.write_payload

    def slow(payload, path):  # type: ignore[no-untyped-def]
        say(f"writing step {payload['step']}")
        time.sleep(seconds)
        write(payload, path)
        say(f"written step {payload['step']}")

    one_process.write_payload = ranks.write_payload = slow  # where the savers write payloads


def _linger(where: str, seconds: float) -> None:
    say(f"lingering in {where}")
    time.sleep(seconds)


def train(args: argparse.Namespace) -> int:

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 16, generator=gen)
    y = (x @ torch.randn(16, 1, generator=gen)).squeeze(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, args.width),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(args.width, 1),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    # without --grace: the detected platform's default config (watchers, grace window)
    config = None if args.grace is None else preemptible.TerminationConfig(grace_period=args.grace)
    state = {"model": model, "optimizer": opt, "scheduler": sched}
    if args.slow_save:
        state["slow"] = SlowState(args.slow_save)
    handler = preemptible.PreemptionCheckpointHandler(
        args.ckpt,
        state=state,
        termination_config=config,
        save_every_steps=args.save_every,
        keep=args.keep,
        async_save=args.async_save,
    )
    loader_iter = None
    if args.workers:
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y),
            batch_size=32,
            num_workers=args.workers,
            persistent_workers=True,
        )
    start = handler.resume()
    say(f"resumed {start}")
    for step in handler.steps(args.steps):
        say(f"step {step}")
        if args.workers:
            if loader_iter is None:
                loader_iter = iter(loader)
            try:
                xb, yb = next(loader_iter)
            except StopIteration:
                loader_iter = iter(loader)
                xb, yb = next(loader_iter)
        else:
            idx = torch.randint(0, x.shape[0], (32,))
            xb, yb = x[idx], y[idx]
        noise = random.gauss(0, 0.01) + float(np.random.normal(0, 0.01))
        loss = torch.nn.functional.mse_loss(model(xb).squeeze(1), yb + noise)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
    torch.save(model.state_dict(), args.out)
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
