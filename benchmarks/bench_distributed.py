"""torch.distributed (gloo, CPU): what the stop agreement costs per step, and signal to exit.

Part 1, for 2 and 4 ranks, four loops interleaved in one run (the order rotated each round):
a bare ``range`` loop, ``handler.steps()`` (the store-polled agreement), the same handler made
as if there were no process group (what the agreement adds), and a loop that all-reduces a
stop flag every step (what a trainer without an agreement does). Once with an
empty step body (the cost of the check alone) and once with a small DDP training step. The
time of a loop is the slowest rank's; medians over the rounds.

Part 2, 4 ranks: SIGTERM to rank 1 while the ranks train; from the signal to the moment every
rank has committed the stop and calls its exit function, against the save time rank 0 measured
(rank 0 writes the whole state); and to the moment every process is gone.

    .venv/bin/python benchmarks/bench_distributed.py [--steps 200] [--repeats 5]
        [--sizes 10 400] [--exit-repeats 3] [--parts steps exit]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from _common import machine, median, table

MODES = ("bare", "handler", "alone", "allreduce")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(world: int, args: list[str]) -> list[subprocess.Popen[str]]:
    port = str(free_port())
    procs = []
    for r in range(world):
        env = {
            **os.environ,
            "RANK": str(r),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


# -- inside a rank -----------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import preemptible.distributed._group as handler_module
    from preemptible import PreemptionCheckpointHandler, TerminationConfig

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = args.width
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
    )
    extra = torch.nn.Linear(1, max(1, int(args.state_mb * 2**20 / 4)), bias=False)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, width)

    def train_step() -> None:
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    def nothing() -> None:
        pass

    step = train_step

    config = TerminationConfig()
    state = {"model": model, "optimizer": opt, "extra": extra}
    if args.mode == "exit":
        started = time.monotonic()

        def exit_fn(code: int) -> None:
            print(f"EXITFN {time.time()!r}", flush=True)
            if rank == 0:
                print("SAVE " + json.dumps(handler.save_times.max()), flush=True)
            sys.exit(code)

        config = TerminationConfig(exit_fn=exit_fn)
        handler = PreemptionCheckpointHandler(args.ckpt, state=state, termination_config=config)
        for i in handler.steps(10**9):
            step()
            if rank == 0 and i == 20:
                print(f"READY {time.monotonic() - started:.1f}", flush=True)
        return

    def timed(mode: str, n: int, step: Callable[[], None]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        if mode == "bare":
            for _ in range(n):
                step()
        elif mode in ("handler", "alone"):
            # "alone": the same handler as if there were no process group (no agreement);
            # each rank its own directory then, as separate runs would have
            where = args.ckpt if mode == "handler" else f"{args.ckpt}/alone-{rank}"
            detect = handler_module.Ranks.detect
            if mode == "alone":
                handler_module.Ranks.detect = lambda: None  # type: ignore[method-assign]
            try:
                h = PreemptionCheckpointHandler(where, state=state, termination_config=config)
            finally:
                handler_module.Ranks.detect = detect  # type: ignore[method-assign]
            h.resume()
            t0 = time.perf_counter()
            for _ in h.steps(n):
                step()
        else:
            for _ in range(n):
                step()
                flag = torch.zeros(1)
                dist.all_reduce(flag)
                if flag.item():
                    break
        took = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took.item())

    results = {}
    for body, fn, n in (("empty", nothing, args.steps * 100), ("train", train_step, args.steps)):
        for mode in MODES:  # warm up
            timed(mode, 20, fn)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(args.repeats):
            order = MODES[i % len(MODES) :] + MODES[: i % len(MODES)]
            for mode in order:
                # an empty loop of all-reduces takes ms per step: a tenth of the steps will do
                k = n // 10 if body == "empty" and mode == "allreduce" else n
                times[mode].append(timed(mode, k, fn) / k)
        results[body] = times
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------------


def per_step(world: int, args: argparse.Namespace) -> list[list[object]]:
    with tempfile.TemporaryDirectory() as ckpt:
        procs = launch(
            world,
            [
                "--mode",
                "steps",
                "--ckpt",
                ckpt,
                "--steps",
                str(args.steps),
                "--repeats",
                str(args.repeats),
                "--width",
                str(args.width),
            ],
        )
        out = [p.communicate(timeout=3600)[0] for p in procs]
    found = [ln for ln in out[0].splitlines() if ln.startswith("RESULT ")]
    if len(found) != 1:
        raise RuntimeError("rank 0 gave no result:\n" + "\n".join(out))
    rows = []
    for body, times in json.loads(found[0].split(" ", 1)[1]).items():
        med = {m: median(v) for m, v in times.items()}
        rows.append(
            [
                world,
                body,
                _us(med["bare"]),
                _us(med["alone"]),
                _us(med["handler"]),
                _us(med["allreduce"]),
                _us(med["handler"] - med["alone"]),
                _us(med["allreduce"] - med["bare"]),
                f"{med['handler'] / med['bare']:.3f}",
                f"{med['allreduce'] / med['bare']:.3f}",
            ]
        )
    return rows


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs" if abs(seconds) < 1e-3 else f"{seconds * 1e3:.2f} ms"


def signal_to_exit(state_mb: float, args: argparse.Namespace) -> tuple[float, float, float]:
    """(signal -> every rank committed the stop, rank 0's save, signal -> every rank gone)."""
    with tempfile.TemporaryDirectory() as ckpt:
        procs = launch(
            4,
            ["--mode", "exit", "--ckpt", ckpt, "--state-mb", str(state_mb), "--width", "64"],
        )
        lines: list[str] = []  # every rank's, as they come
        ready = threading.Event()

        def collect(p: subprocess.Popen[str]) -> None:
            assert p.stdout is not None
            for line in p.stdout:
                lines.append(line.strip())
                if line.startswith("READY"):
                    ready.set()

        readers = [threading.Thread(target=collect, args=(p,), daemon=True) for p in procs]
        for t in readers:
            t.start()
        if not ready.wait(600):
            for p in procs:
                p.kill()
            raise RuntimeError("the ranks did not start:\n" + "\n".join(lines))
        sent = time.time()
        procs[1].send_signal(signal.SIGTERM)
        codes = [p.wait(600) for p in procs]
        gone = time.time() - sent
        for t in readers:
            t.join(10)
    assert codes == [143] * 4, (codes, lines)
    [save] = [float(ln.split()[1]) for ln in lines if ln.startswith("SAVE ")]
    exits = [float(ln.split()[1]) for ln in lines if ln.startswith("EXITFN ")]
    assert len(exits) == 4, lines
    return max(exits) - sent, save, gone


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="steps", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default="", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--width", type=int, default=256, help="the model's width (step size)")
    p.add_argument("--state-mb", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--exit-repeats", type=int, default=3)
    p.add_argument("--sizes", type=float, nargs="*", default=[10.0, 400.0], help="state MB")
    p.add_argument("--parts", nargs="*", default=["steps", "exit"], choices=["steps", "exit"])
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    print(f"machine: {machine()}")
    if "steps" in args.parts:
        per_step_table(args)
    if "exit" in args.parts:
        exit_table(args)


def per_step_table(args: argparse.Namespace) -> None:
    rows = [row for world in (2, 4) for row in per_step(world, args)]
    print(
        f"\nper step, median of {args.repeats} interleaved rounds ({args.steps * 100} empty "
        f"steps, {args.steps * 10} for the all-reduce; {args.steps} training steps)\n"
    )
    print(
        table(
            [
                "ranks",
                "step body",
                "bare",
                "steps(), no agreement",
                "steps()",
                "all-reduce flag",
                "agreement adds",
                "all-reduce adds",
                "steps() / bare",
                "all-reduce / bare",
            ],
            rows,
        )
    )


def exit_table(args: argparse.Namespace) -> None:
    exit_rows = []
    for mb in args.sizes:
        runs = [signal_to_exit(mb, args) for _ in range(args.exit_repeats)]
        committed, save, gone = (median([r[i] for r in runs]) for i in range(3))
        exit_rows.append(
            [
                f"{mb:g} MB",
                f"{save:.2f} s",
                f"{committed:.2f} s",
                f"{committed - save:.2f} s",
                f"{gone:.2f} s",
            ]
        )
    print(f"\n4 ranks, SIGTERM to rank 1; median of {args.exit_repeats}\n")
    print(
        table(
            [
                "extra state",
                "save (rank 0)",
                "signal → all committed",
                "all committed - save",
                "signal → all gone",
            ],
            exit_rows,
        )
    )


if __name__ == "__main__":
    main()
