"""A small torch.distributed (gloo, CPU) training job for the multi-rank tests.

Run under torchrun, or started rank by rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
set. Every rank draws its own batches and noise from its own random streams (seeded by rank)
and DDP averages the gradients, so the final weights depend on every rank's streams: a resume
ends with the weights of an uninterrupted run only if each rank got its own streams back.

Prints ``rank R step N`` when step N starts and ``rank R stopped at S`` style log lines
(``logging`` with the rank in front), so a test can signal a chosen rank at a chosen step.
At the end each rank writes ``OUT.rank<R>.json`` with draws from its streams, and rank 0
writes the weights to ``OUT``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import preemptible

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line


def say(line: str) -> None:
    """One write per line: the background writer prints too, and print() writes the text and
    the newline separately, so two threads' lines could run together ("rank 0 step 8rank 0
    wrote step 5")."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def slow_down_writes(seconds: float) -> None:
    """Each checkpoint file is held ``seconds`` between its write and its commit (rename), so a
    test can kill a rank while a checkpoint exists only under its temporary name."""
    import preemptible.checkpoint._savers as one_process
    import preemptible.distributed._savers as ranks

    write = one_process.write_payload

    def slow(payload, path):  # type: ignore[no-untyped-def]
        write(payload, path)
        say(f"rank {dist.get_rank()} wrote step {payload['step']}")
        time.sleep(seconds)

    one_process.write_payload = ranks.write_payload = slow  # where the savers write payloads


def notice_when(path: Path, grace: float):  # type: ignore[no-untyped-def]
    """A watcher: a notice with ``grace`` seconds to go once ``path`` exists."""

    def watch() -> preemptible.Notice | None:
        if path.exists():
            return preemptible.Notice(source="test-notice", deadline=time.time() + grace)
        return None

    return watch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--slow-rank", type=int, default=None, help="this rank sleeps longer")
    p.add_argument("--slow-sleep", type=float, default=0.0)
    p.add_argument("--save-every", type=int, default=None)
    p.add_argument("--save-every-seconds", type=float, default=None)
    p.add_argument("--async-save", action="store_true", help="periodic saves in the background")
    p.add_argument(
        "--loop",
        choices=["steps", "run", "own"],
        default="steps",
        help="handler.steps(), handler.run(), or a loop of our own with should_stop/stop()",
    )
    p.add_argument("--slow-write", type=float, default=0.0, help="seconds before each commit")
    p.add_argument("--notice-file", default=None, help="a notice reaches --notice-rank then")
    p.add_argument("--notice-rank", type=int, default=1)
    p.add_argument("--grace", type=float, default=None)
    p.add_argument("--sharded", action="store_true")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (DTensor) model: sharded saves")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(
        level=logging.INFO, format=f"rank {rank}: %(message)s", stream=sys.stdout, force=True
    )
    # the library says "saved ..." at INFO on rank 0 only (DEBUG elsewhere); the tests compare
    # every rank's saves, so they are shown from every rank, and no other DEBUG line
    lib = logging.getLogger("preemptible")
    lib.setLevel(logging.DEBUG)
    saved = re.compile(r"preemptible: (rank \d+: )?saved")
    lib.addFilter(lambda r: r.levelno > logging.DEBUG or saved.match(r.getMessage()) is not None)
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights on every rank
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 8, generator=gen)
    y = (x @ torch.randn(8, 1, generator=gen)).squeeze(1)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    )
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        net = model
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # each rank its own streams
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)

    watcher = None
    if args.notice_file and rank == args.notice_rank:
        watcher = notice_when(Path(args.notice_file), args.grace or 0.0)
    config = preemptible.TerminationConfig(
        termination_watcher_fn=watcher, grace_period=args.grace, poll_interval=0.05
    )
    state: dict[str, object] = {"model": model, "optimizer": opt}
    if args.slow_write:
        slow_down_writes(args.slow_write)
    handler = preemptible.PreemptionCheckpointHandler(
        args.ckpt,
        state=state,
        termination_config=config,
        save_every_steps=args.save_every,
        save_every_seconds=args.save_every_seconds,
        async_save=args.async_save,
        **({"sharded": True} if args.sharded else {}),  # type: ignore[arg-type]
    )
    start = handler.resume()
    say(f"rank {rank} resumed {start}")

    def train_step(step: int) -> None:
        say(f"rank {rank} step {step}")
        idx = torch.randint(0, x.shape[0], (16,))
        noise = random.gauss(0, 0.01) + float(np.random.normal(0, 0.01))
        loss = torch.nn.functional.mse_loss(net(x[idx]).squeeze(1), y[idx] + noise)
        opt.zero_grad()
        loss.backward()
        opt.step()
        pause = args.step_sleep
        if args.slow_rank == rank:
            pause += args.slow_sleep
        if pause:
            time.sleep(pause)

    if args.loop == "steps":
        for step in handler.steps(args.steps):
            train_step(step)
    elif args.loop == "run":
        for step in range(start, args.steps):
            handler.run(train_step, step)
        handler.close()
    else:
        for step in range(start, args.steps):
            if handler.should_stop:
                handler.stop()
            train_step(step)
            handler.step = step + 1
        handler.close()

    draws = {
        "torch": torch.rand(3).tolist(),
        "python": random.random(),
        "numpy": float(np.random.rand()),
    }
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(draws))
    weights = {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v
        for k, v in model.state_dict().items()
    }
    if rank == 0:
        torch.save(weights, args.out)
    dist.barrier()
    dist.destroy_process_group()
    say(f"rank {rank} done {world}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
