"""What a checkpoint costs against its physical limits, side by side in one run (issue 33).

For each state size, in rounds (the machine's and the disk's moods shared by every figure of a
round), each figure beside the limit measured in the same round:

  async stall   the stall of an ``async_save=True`` save point, saves after the first (the
                staging buffers ready), over the *copy limit*: the same tensors copied into
                host buffers allocated once and reused, just before each save point (a memcpy
                on the CPU; pinned buffers on a side stream on a GPU). The first save beside it.
                One child of ``bench_async_stall.py``.
  sync save     ``handler.save()`` of one file (``torch.save``, fsync, rename, fsync of the
                directory), with ``keep=1`` retiring the one before and with nothing to retire,
                and of a sharded checkpoint (``sharded=True``: torch.distributed.checkpoint's
                writer, ``keep=1``), over the *raw write*: the same number of random bytes
                written 16 MiB a call and fsynced, on the same disk (the file's removal after
                it is not timed). The four interleaved in one child, the order rotated. A
                retired checkpoint is deleted by a thread of the store; the next figure waits
                for it, untimed, as a loop's next steps would overlap it.
  stop          SIGTERM to a child in its loop (100 ms steps) that resumed from a checkpoint of
                its own (so ``keep=1`` has one to retire): its stop's save over the raw write
                the child made just before its loop, and signal -> process gone over that
                save. One child of ``bench_signal_to_exit.py``. Beside it, signal -> gone over
                what no stop can go below: the rest of the step, the save, and a *bare exit*:
                a child with the same state (torch, no preemptible) that leaves by
                ``sys.exit`` from its signal handler, as fast as a Python program's exit goes
                (``gc.freeze()`` first, as preemptible's). The same child by ``os._exit``
                shows the kernel's part (freeing the memory) in the line below the table.

    .venv/bin/python benchmarks/bench_checkpoint_cost.py [--sizes 400 1000] [--repeats 3]
        [--device cpu|cuda] [--dir DIR] [--src DIR]

``--src DIR``: the children import preemptible from DIR (another version, for before/after).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_async_stall
import bench_signal_to_exit
from _common import disk_of, machine, median, table, write_and_fsync

TENSORS = 8


def saves_child(size_mb: int, directory: str, rounds: int, offset: int, device: str) -> None:
    """Raw write, one-file save and sharded save, ``rounds`` times each, interleaved (the
    order rotated, starting ``offset`` along)."""
    import torch

    from preemptible import PreemptionCheckpointHandler

    torch.manual_seed(0)
    n = size_mb * 2**20 // 4 // TENSORS
    model = torch.nn.ParameterDict(
        {f"w{i}": torch.nn.Parameter(torch.randn(n, device=device)) for i in range(TENSORS)}
    )
    nbytes = TENSORS * n * 4
    base = Path(directory)
    handlers = {
        "single": PreemptionCheckpointHandler(base / "single", {"model": model}, keep=1),
        "kept": PreemptionCheckpointHandler(base / "kept", {"model": model}, keep=1000),
        "sharded": PreemptionCheckpointHandler(
            base / "sharded", {"model": model}, keep=1, sharded=True
        ),
    }
    for h in handlers.values():  # one committed already: every timed save retires one
        h.save(1)

    def raw() -> None:
        write_and_fsync(base / "raw.bin", nbytes)

    work = {"raw": raw}
    for name, h in handlers.items():
        work[name] = lambda h=h: h.save(h.step + 1)
    order = list(work)
    times: dict[str, list[float]] = {k: [] for k in order}
    for r in range(rounds):
        k = (r + offset) % len(order)
        for name in order[k:] + order[:k]:
            with torch.no_grad():
                first = next(iter(model.values()))
                first[:4096].add_(1e-3)  # the state changes between saves
            t0 = time.perf_counter()
            work[name]()
            times[name].append(time.perf_counter() - t0)
            with contextlib.suppress(FileNotFoundError):
                (base / "raw.bin").unlink()  # not timed: the limit is the write
            for h in handlers.values():  # not timed either: a loop trains while it runs
                if hasattr(h.store, "wait_for_removals"):  # not in a --src before it
                    h.store.wait_for_removals()
    for name, h in handlers.items():
        assert len(h.store.committed()) == (1 if name != "kept" else 1 + rounds)
        h.close()
    print(json.dumps(times))


def run_saves_child(
    size: int, rounds: int, offset: int, device: str, base: Path
) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(dir=base) as d:
        cmd = [sys.executable, __file__, "--child", str(size), d, str(rounds), str(offset), device]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        size, directory, rounds, offset, device = sys.argv[2:7]
        saves_child(int(size), directory, int(rounds), int(offset), device)
        return
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[400, 1000], help="state, MiB")
    p.add_argument("--repeats", type=int, default=3, help="rounds")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state is")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: the temp dir)")
    p.add_argument("--src", default=None, help="PYTHONPATH of the children (another version)")
    args = p.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    if args.src:
        os.environ["PYTHONPATH"] = args.src  # every child below inherits it
    base = Path(args.dir or tempfile.gettempdir())
    stall_args = argparse.Namespace(saves=3, threads=1, sharded=False, device=args.device)
    stall_args.src = args.src
    rng = random.Random(0)
    rows, lines = [], []
    for size in args.sizes:
        got: dict[str, list[float]] = {}

        def add(key: str, values: list[float], got: dict[str, list[float]] = got) -> None:
            got.setdefault(key, []).extend(values)

        for r in range(args.repeats):
            stall = bench_async_stall.run_child(stall_args, size, "async", 100 + 3 * size, base)
            add(
                "stall/limit",
                [s / x for s, x in zip(stall["stalls"][1:], stall["limits"][1:], strict=True)],
            )
            add("first/limit", [stall["stalls"][0] / stall["limits"][0]])
            add("stall", stall["stalls"][1:])
            add("limit", stall["limits"])
            saves = run_saves_child(size, 1, r, args.device, base)
            for k in ("single", "kept", "sharded"):
                add(k, saves[k])
                add(f"{k}/raw", [s / r for s, r in zip(saves[k], saves["raw"], strict=True)])
            add("raw", saves["raw"])
            with tempfile.TemporaryDirectory(dir=base) as d:
                stop = bench_signal_to_exit.one(size, 0.1, Path(d), rng, args.device, None, True)
            floor = bench_signal_to_exit.bare_exit(size, rng, args.device, "os._exit")
            plain = bench_signal_to_exit.bare_exit(size, rng, args.device, "sys.exit")
            add("stop save/raw", [stop["save"] / stop["raw"]])
            add("gone/save", [stop["total"] / stop["save"]])
            # what a stop cannot go below: the step's end, its save, a Python program's exit
            add("gone/anchor", [stop["total"] / (stop["wait"] + stop["save"] + plain)])
            add("floor", [floor])
            add("plain", [plain])
            add("stop save", [stop["save"]])
            add("gone", [stop["total"]])
            add("boundary", [stop["wait"]])
            add("exit", [stop["exit"]])
        m = {k: median(v) for k, v in got.items()}
        rows.append(
            [
                f"{size} MiB",
                ms(m["limit"]),
                f"{ms(m['stall'])} ({m['stall/limit']:.2f})",
                f"{m['first/limit']:.2f}",
                ms(m["raw"]),
                f"{ms(m['single'])} ({m['single/raw']:.2f})",
                f"{ms(m['kept'])} ({m['kept/raw']:.2f})",
                f"{ms(m['sharded'])} ({m['sharded/raw']:.2f})",
                f"{ms(m['stop save'])} ({m['stop save/raw']:.2f})",
                f"{ms(m['gone'])} ({m['gone/save']:.2f})",
                f"{m['gone/anchor']:.2f}",
            ]
        )
        lines.append(
            f"{size} MiB: signal -> gone = {ms(m['boundary'])} to the step's end + the save + "
            f"{ms(m['exit'])} from exit_fn to gone; a child with the same state that leaves "
            f"from its handler is gone {ms(m['plain'])} after the signal by sys.exit, "
            f"{ms(m['floor'])} by os._exit (the kernel freeing its memory) (medians)"
        )
    print(
        f"machine: {machine()}; disk {disk_of(str(base))}; state on {args.device}; "
        f"median of {args.repeats} rounds (of the per-save ratios for the async stall)"
        f"{'; source ' + args.src if args.src else ''}\n"
    )
    header = ["state", "copy limit", "async stall (/limit)", "first save /limit"]
    header += ["raw write + fsync", "sync save, retiring one (/raw)", "nothing to retire (/raw)"]
    header += ["sharded save (/raw)"]
    header += [
        "stop's save (/raw)",
        "signal → gone (/save)",
        "gone / (step end + save + bare exit)",
    ]
    print(table(header, rows))
    print()
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
