"""Cost of ``import preemptible`` (and that it imports no heavy library).

Runs ``python -c pass`` and ``python -c "import preemptible"`` alternately in fresh processes
and reports the medians and their difference; ``-X importtime`` gives the module's own time.

    .venv/bin/python benchmarks/bench_import.py [--repeats 21]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

from _common import machine, median, table


def run(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=21)
    args = p.parse_args()
    base, imp, cli = [], [], []
    for _ in range(args.repeats):
        base.append(run("pass"))
        imp.append(run("import preemptible"))
        cli.append(run("import preemptible.cli._main"))
    err = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import preemptible"],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    own = [int(m.group(1)) for m in re.finditer(r"\|\s+(\d+) \| preemptible$", err, re.M)]
    heavy = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, preemptible; print(sorted(m for m in "
            "('torch','numpy','lightning','mlflow','wandb') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    b = median(base)
    rows = [
        ["python -c pass", f"{b * 1000:.1f} ms", "—"],
        [
            "import preemptible",
            f"{median(imp) * 1000:.1f} ms",
            f"{(median(imp) - b) * 1000:.1f} ms",
        ],
        [
            "import preemptible.cli._main (click)",
            f"{median(cli) * 1000:.1f} ms",
            f"{(median(cli) - b) * 1000:.1f} ms",
        ],
    ]
    print(f"machine: {machine()}; median of {args.repeats} fresh processes\n")
    print(table(["command", "wall", "over bare python"], rows))
    print(
        f"\n-X importtime, cumulative for preemptible: {own[0] / 1000 if own else '?'} ms; "
        f"heavy modules imported: {heavy}"
    )


if __name__ == "__main__":
    main()
