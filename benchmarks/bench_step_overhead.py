"""Per-step overhead of ``handler.steps()`` over a bare ``range`` loop.

Both loops run side by side, interleaved, in one process; the body is empty (the worst case
for relative overhead) and a 20 µs busy loop (a very small training step).

    .venv/bin/python benchmarks/bench_step_overhead.py [--steps 200000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from _common import machine, median, table

from preemptible import PreemptionCheckpointHandler


def busy(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def bare(n: int, body_us: float) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        if body_us:
            busy(body_us)
    return time.perf_counter() - t0


def handled(n: int, body_us: float, directory: str) -> float:
    h = PreemptionCheckpointHandler(directory)
    t0 = time.perf_counter()
    for _ in h.steps(n):
        if body_us:
            busy(body_us)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    rows = []
    for body_us, n in ((0.0, args.steps), (20.0, args.steps // 10)):
        a, b = [], []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as d:
                a.append(bare(n, body_us))
                b.append(handled(n, body_us, d))
        ma, mb = median(a), median(b)
        rows.append(
            [
                f"{body_us:g} µs",
                n,
                f"{ma / n * 1e9:.0f} ns",
                f"{mb / n * 1e9:.0f} ns",
                f"{(mb - ma) / n * 1e9:.0f} ns",
                f"{mb / ma:.2f}",
            ]
        )
    print(f"machine: {machine()}; median of {args.repeats} interleaved runs\n")
    print(
        table(
            ["step body", "steps", "range()/step", "steps()/step", "overhead/step", "ratio"], rows
        )
    )


if __name__ == "__main__":
    main()
