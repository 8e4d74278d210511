"""Save throughput of ``handler.save()`` against ``dd`` writing the same bytes to the same disk.

Side by side in one run, interleaved, median of --repeats:
  dd            dd if=/dev/zero bs=16M conv=fsync (the disk's sequential write rate, synced)
  raw write     the state's own bytes written by os.write (16 MiB a call) and fsynced: the
                physical limit for this save, the same number of bytes
  torch.save    torch.save(state, path) alone, no fsync (what a naive loop does)
  + fsync       the same, then fsync the file (durable, but not atomic)
  handler.save  payload + torch.save through a Python file + fsync + rename + fsync(dir)

    .venv/bin/python benchmarks/bench_save_throughput.py [--mb 1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from _common import disk_of, machine, median, table, write_and_fsync

from preemptible import PreemptionCheckpointHandler


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    base = Path(args.dir or tempfile.gettempdir())
    model = torch.nn.ParameterDict(
        {f"w{i}": torch.nn.Parameter(torch.randn(args.mb * 2**20 // 4 // 8)) for i in range(8)}
    )
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    results: dict[str, list[float]] = {
        "dd": [],
        "raw write + fsync": [],
        "torch.save": [],
        "torch.save + fsync": [],
        "handler.save": [],
    }
    with tempfile.TemporaryDirectory(dir=base) as d:
        work = Path(d)
        handler = PreemptionCheckpointHandler(work / "ckpt", {"model": model}, keep=1)
        blocks = nbytes // (16 << 20) + 1

        def dd() -> None:
            subprocess.run(
                [
                    "dd",
                    "if=/dev/zero",
                    f"of={work / 'dd.bin'}",
                    "bs=16M",
                    f"count={blocks}",
                    "conv=fsync",
                ],
                check=True,
                capture_output=True,
            )

        def raw() -> None:
            write_and_fsync(work / "raw.bin", nbytes)

        def plain() -> None:
            torch.save({"model": model.state_dict()}, work / "plain.pt")

        def plain_fsync() -> None:
            with open(work / "plain.pt", "wb") as fh:
                torch.save({"model": model.state_dict()}, fh)
                fh.flush()
                os.fsync(fh.fileno())

        writers = {
            "dd": dd,
            "raw write + fsync": raw,
            "torch.save": plain,
            "torch.save + fsync": plain_fsync,
            "handler.save": handler.save,
        }
        order = list(writers)
        for i in range(args.repeats):
            for name in order[i % len(order) :] + order[: i % len(order)]:  # rotate the order
                results[name].append(timed(writers[name]))
                for f in ("dd.bin", "plain.pt", "raw.bin"):
                    (work / f).unlink(missing_ok=True)
        handler.close()
    dd = median(results["dd"])
    raw_s = results["raw write + fsync"]
    rows = []
    for name, times in results.items():
        m = median(times)
        size = blocks * 16 if name == "dd" else nbytes / 2**20
        rows.append(
            [
                name,
                f"{size:.0f} MiB",
                f"{m:.2f} s",
                f"{size / m:.0f} MiB/s",
                f"{(size / m) / ((blocks * 16) / dd):.2f}",
                # per round, against the raw write of that round (the disk varies)
                f"{median([t / r for t, r in zip(times, raw_s, strict=True)]):.2f}",
            ]
        )
    print(f"machine: {machine()}; disk {disk_of(str(base))}; median of {args.repeats}\n")
    print(table(["writer", "bytes", "time", "rate", "rate vs dd", "time / raw write"], rows))


if __name__ == "__main__":
    main()
