"""Time from SIGTERM to process exit for a 100 MB and a 1 GB state, split into phases.

A child process trains with 100 ms steps over a state of the given size and is sent SIGTERM
at a random moment of a step. Phases:
  wait    signal received -> step boundary reached (at most one step)
  save    building the payload + torch.save + fsync + rename + fsync(dir)
  exit    exit_fn called -> process gone (interpreter and torch shutdown)
  total   signal sent (by this script) -> process gone (waitpid returned)

    .venv/bin/python benchmarks/bench_signal_to_exit.py [--sizes 100,1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import disk_of, machine, median, table

CHILD = r"""
import json, os, sys, time
import torch
import preemptible

size_mb, step_s, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
weights = torch.nn.ParameterDict({
    f"w{i}": torch.nn.Parameter(torch.randn(size_mb * 2**20 // 4 // 8))
    for i in range(8)
})

def exit_fn(code):
    t_exit = time.time()
    notice = handler.notices[0]
    json.dump({"received": notice.received_at, "exit_fn": t_exit,
               "save": handler.save_times.max(), "code": code}, open(out, "w"))
    os.sys.exit(code)

handler = preemptible.PreemptionCheckpointHandler(
    sys.argv[4], {"model": weights}, keep=1,
    termination_config=preemptible.TerminationConfig(exit_fn=exit_fn))
print("ready", flush=True)
for step in handler.steps(10**9):
    time.sleep(step_s)
"""


def one(size_mb: int, step_s: float, workdir: Path, rng: random.Random) -> dict[str, float]:
    out = workdir / "times.json"
    ckpt = workdir / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(size_mb), str(step_s), str(out), str(ckpt)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(rng.uniform(0.3, 0.5))  # a random moment inside a step
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=600)
    gone = time.time()
    assert code == 143, code
    t = json.loads(out.read_text())
    save = t["save"]
    return {
        "wait": t["exit_fn"] - save - t["received"],
        "save": save,
        "exit": gone - t["exit_fn"],
        "total": gone - sent,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="100,1000", help="state sizes in MB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--step", type=float, default=0.1, help="step time in seconds")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    args = p.parse_args()
    rng = random.Random(0)
    rows = []
    base = args.dir or tempfile.gettempdir()
    for size in (int(s) for s in args.sizes.split(",")):
        runs = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(dir=base) as d:
                runs.append(one(size, args.step, Path(d), rng))
        med = {k: median([r[k] for r in runs]) for k in runs[0]}
        rows.append(
            [
                f"{size} MB",
                f"{med['wait'] * 1000:.0f} ms",
                f"{med['save']:.2f} s",
                f"{size / med['save']:.0f} MB/s",
                f"{med['exit']:.2f} s",
                f"{med['total']:.2f} s",
            ]
        )
    print(
        f"machine: {machine()}; disk {disk_of(base)}; step {args.step * 1000:.0f} ms; "
        f"median of {args.repeats}\n"
    )
    print(table(["state", "wait for boundary", "save", "save rate", "exit", "signal → gone"], rows))


if __name__ == "__main__":
    main()
