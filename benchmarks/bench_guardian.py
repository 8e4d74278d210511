"""What containing an attempt costs: the guardian's CPU, the time to a clean tree after
``kill -9`` of the supervisor, and the start of an attempt; cgroup v2 against the /proc
guardian (``PREEMPTIBLE_CONTAINMENT``), side by side.

CPU: a job that sleeps T seconds, then reads the user+system time of its guardian (its
sibling running ``_guard.py``) and of its supervisor from /proc. T = 5 s and 20 s; the
difference over 15 s is the steady state, given per hour. With ``--crowd N`` the machine also
runs N idle processes, which the /proc guardian's look at ``/proc`` has to list.

Kill: a job that starts 4 children in sessions of their own (as torchrun does) and waits; the
supervisor is SIGKILLed once they run; the time until none of them runs (polled every 2 ms).

Start: the wall time of ``preemptible run -- true`` against plain ``true``, and the guardian's
own start (``python -I -S _guard.py``, standard library only) against importing the package.

    .venv/bin/python benchmarks/bench_guardian.py [--repeats 5] [--crowd 500]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, median, table

from preemptible.supervisor import _guard
from preemptible.supervisor._cgroup import probe

PY = sys.executable
IDLE = r"""
import os, sys, time
time.sleep(float(sys.argv[1]))
def cpu(pid):  # seconds on a CPU, from the scheduler's nanoseconds (/proc's ticks are 10 ms)
    return int(open(f"/proc/{pid}/schedstat").read().split()[0]) / 1e9
def guards(sup):
    for p in os.listdir("/proc"):
        try:
            ppid = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]
            argv = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
            if ppid == str(sup) and any(a.endswith(b"/_guard.py") for a in argv):
                yield int(p)
        except (OSError, ValueError):
            continue
sup = os.getppid()
guard = next(guards(sup))
print("cpu", cpu(sup), cpu(guard), sum(p.isdigit() for p in os.listdir("/proc")), flush=True)
"""
WORKERS = r"""
import subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True) for _ in range(4)]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(600)
"""


def run_cmd(home: str, mode: str, *job: str) -> list[str]:
    return [PY, "-m", "preemptible", "run", "--home", home, "--", *job]


def env_for(mode: str) -> dict[str, str]:
    return {**os.environ, "PREEMPTIBLE_CONTAINMENT": mode}


def cpu(mode: str, seconds: float, home: str) -> tuple[float, float, int]:
    out = subprocess.run(
        run_cmd(home, mode, PY, "-c", IDLE, str(seconds)),
        capture_output=True,
        text=True,
        check=True,
        env=env_for(mode),
    ).stdout
    fields = out.split("cpu", 1)[1].split()
    return float(fields[0]), float(fields[1]), int(fields[2])


def kill_to_clean(mode: str, home: str) -> float:
    proc = subprocess.Popen(
        run_cmd(home, mode, PY, "-c", WORKERS),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env_for(mode),
        start_new_session=True,
    )
    assert proc.stdout is not None
    kids = [int(p) for p in proc.stdout.readline().split()]
    starts = {pid: _guard.read_proc(pid) for pid in kids}
    time.sleep(0.3)  # the guardian has looked at /proc a few times
    t0 = time.perf_counter()
    os.kill(proc.pid, signal.SIGKILL)
    while any(
        (p := _guard.read_proc(pid)) is not None and not p.zombie and p == starts[pid]
        for pid in kids
    ):
        time.sleep(0.002)
    took = time.perf_counter() - t0
    proc.wait()
    return took


def wall(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    return time.perf_counter() - t0


def guard_start() -> float:
    config = json.dumps({"supervisor": os.getpid(), "job": os.getpid(), "cgroup": None})
    t0 = time.perf_counter()
    subprocess.run(
        [PY, "-I", "-S", str(Path(_guard.__file__)), config], input=b"done\n", check=True
    )
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--crowd", type=int, default=500)
    args = p.parse_args()
    modes = ["cgroup", "proc"] if probe().kind == "cgroup" else ["proc"]
    print(f"machine: {machine()}; cgroup here: {probe().describe()}\n")
    with tempfile.TemporaryDirectory() as home:
        for crowd in (0, args.crowd):
            idle = [
                subprocess.Popen(["sleep", "3600"], stdout=subprocess.DEVNULL) for _ in range(crowd)
            ]
            try:
                rows = []
                for mode in modes:
                    short = [cpu(mode, 5, home) for _ in range(args.repeats)]
                    long = [cpu(mode, 20, home) for _ in range(args.repeats)]
                    per_hour = [
                        (median([x[i] for x in long]) - median([x[i] for x in short])) / 15 * 3600
                        for i in (0, 1)
                    ]
                    rows.append(
                        [
                            mode,
                            long[0][2],
                            f"{median([x[1] for x in short]) * 1e3:.0f} ms",
                            f"{median([x[1] for x in long]) * 1e3:.0f} ms",
                            f"{per_hour[1]:.1f} s/h ({per_hour[1] / 36:.2f} % of a core)",
                            f"{per_hour[0]:.1f} s/h ({per_hour[0] / 36:.2f} %)",
                        ]
                    )
                print(
                    f"CPU while an attempt runs, {crowd} extra idle processes, median of "
                    f"{args.repeats}\n"
                )
                print(
                    table(
                        [
                            "containment",
                            "processes",
                            "guardian 5 s",
                            "guardian 20 s",
                            "guardian steady",
                            "supervisor steady",
                        ],
                        rows,
                    )
                )
                print()
            finally:
                for q in idle:
                    q.kill()
                    q.wait()
        rows = []
        for mode in modes:
            took = [kill_to_clean(mode, home) for _ in range(args.repeats)]
            rows.append([mode, f"{median(took) * 1e3:.0f} ms", f"{max(took) * 1e3:.0f} ms"])
        print(
            f"kill -9 of the supervisor → its 4 workers (own sessions) gone, {args.repeats} runs\n"
        )
        print(table(["containment", "median", "max"], rows))
        plain, runs = [], {m: [] for m in modes}
        for _ in range(args.repeats):
            plain.append(wall(["true"]))
            for mode in modes:
                runs[mode].append(wall(run_cmd(home, mode, "true"), env_for(mode)))
        print(f"\nstart and end of an attempt, median of {args.repeats} interleaved\n")
        rows = [["plain true", f"{median(plain) * 1e3:.0f} ms"]]
        rows += [
            [f"preemptible run -- true ({m})", f"{median(runs[m]) * 1e3:.0f} ms"] for m in modes
        ]
        starts = [guard_start() for _ in range(args.repeats)]
        imports = [
            wall([PY, "-c", "import preemptible.supervisor._guard"]) for _ in range(args.repeats)
        ]
        rows.append(["guardian start (python -I -S _guard.py)", f"{median(starts) * 1e3:.0f} ms"])
        rows.append(["for comparison: import preemptible", f"{median(imports) * 1e3:.0f} ms"])
        print(table(["what", "wall"], rows))


if __name__ == "__main__":
    main()
