"""``preemptible run`` costs: signal forwarding latency and the supervisor's CPU use.

Latency: a Python process under ``bash -c`` (the grandchild of the supervisor) notes the
wall time at which its SIGUSR2 handler runs; this script sends SIGUSR2 to the supervisor N times
and reports p50/p99 of (handler ran - signal sent). The same measured with the signal sent
straight to the trainer is the baseline: the difference is the supervisor's hop.

CPU: the supervisor's own user+system time (read from /proc by the job just before it ends)
while it supervises a busy job of 5 s and of 20 s; the difference is its steady-state cost.
Also the wall time of a fixed CPU-bound job, plain against supervised.

    .venv/bin/python benchmarks/bench_supervisor.py [--signals 200]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

from _common import machine, median, table

PY = sys.executable
TRAINER = r"""
import os, signal, sys, time
def on_usr2(signum, frame):
    os.write(1, f"got {time.time():.6f}\n".encode())
signal.signal(signal.SIGUSR2, on_usr2)
print(f"pid {os.getpid()}", flush=True)
while True:
    signal.pause()
"""
BUSY = r"""
import os, sys, time
end = time.time() + float(sys.argv[1])
n = 0
while time.time() < end:
    n += 1
tick = os.sysconf("SC_CLK_TCK")
stat = open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()
print(f"parent_cpu {(int(stat[11]) + int(stat[12])) / tick:.3f}", flush=True)
"""
WORK = r"""
import sys
total = 0
for i in range(int(sys.argv[1])):
    total += i * i
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latencies(n: int, via_supervisor: bool, home: str) -> list[float]:
    cmd = [PY, "-c", TRAINER]
    if via_supervisor:
        cmd = [
            PY,
            "-m",
            "preemptible",
            "run",
            "--term-timeout",
            "100000",
            "--home",
            home,
            "--",
            "bash",
            "-c",
            f"{PY} -c '{TRAINER}'; true",
        ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    trainer_pid = int(line.split()[1])
    target = proc.pid if via_supervisor else trainer_pid
    out = []
    try:
        for _ in range(n):
            sent = time.time()
            os.kill(target, signal.SIGUSR2)
            got = float(proc.stdout.readline().split()[1])
            out.append(got - sent)
            time.sleep(0.005)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return out


def supervisor_cpu(seconds: float, home: str) -> float:
    out = subprocess.run(
        [PY, "-m", "preemptible", "run", "--home", home, "--", PY, "-c", BUSY, str(seconds)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(out.split("parent_cpu")[1].split()[0])


def wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--signals", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as home:
        direct = latencies(args.signals, False, home)
        hop = latencies(args.signals, True, home)
        rows = [
            [
                "signal → trainer directly",
                f"{percentile(direct, 0.5) * 1e3:.2f} ms",
                f"{percentile(direct, 0.99) * 1e3:.2f} ms",
            ],
            [
                "signal → supervisor → bash's child",
                f"{percentile(hop, 0.5) * 1e3:.2f} ms",
                f"{percentile(hop, 0.99) * 1e3:.2f} ms",
            ],
        ]
        print(f"machine: {machine()}\n")
        print(f"Signal forwarding latency, {args.signals} SIGUSR2 each\n")
        print(table(["path", "p50", "p99"], rows))

        short = median([supervisor_cpu(5, home) for _ in range(args.repeats)])
        long = median([supervisor_cpu(20, home) for _ in range(args.repeats)])
        per_hour = (long - short) / 15 * 3600
        print(f"\nSupervisor CPU (user+sys), median of {args.repeats}\n")
        print(
            table(
                ["job length", "supervisor CPU"],
                [
                    ["5 s", f"{short:.3f} s"],
                    ["20 s", f"{long:.3f} s"],
                    ["steady state", f"{per_hour:.2f} s per hour of job"],
                ],
            )
        )

        n = "80000000"
        plain, sup = [], []
        for _ in range(args.repeats):
            plain.append(wall([PY, "-c", WORK, n]))
            sup.append(
                wall([PY, "-m", "preemptible", "run", "--home", home, "--", PY, "-c", WORK, n])
            )
        print(f"\nA CPU-bound job, median of {args.repeats} interleaved\n")
        print(
            table(
                ["how", "wall", "ratio"],
                [
                    ["plain", f"{median(plain):.2f} s", "1.00"],
                    [
                        "preemptible run --",
                        f"{median(sup):.2f} s",
                        f"{median(sup) / median(plain):.3f}",
                    ],
                ],
            )
        )


if __name__ == "__main__":
    main()
