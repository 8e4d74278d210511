"""A run that floods its metric history, under an agent: do the lease's renewals keep their
period, and how long after the run ends is its attempt recorded?

The run reports ``--metrics`` (500) metrics a step with ``preemptible.report`` as fast as it
can for ``--seconds`` (the file's 64 MiB are full in a few seconds: four million points), then
ends (exit 0, no handler: a stop kills it). One agent (``--count 1``) runs it with
``--heartbeat 0.5 --lease 3`` (issue 31: the agent stopped its own run for a lease it held) and
with the defaults, 10 s / 60 s (it took 48 s to record the run). Each implementation (this
tree's ``src``, and ``--before OLD/src`` when given) runs its agent with that ``PYTHONPATH``,
cases interleaved, on SQLite and PostgreSQL.

Renewals are read from the attempt's ``lease.json``, rewritten at each one with the deadline
(this host's monotonic clock: the renewal's time plus a constant), polled every 10 ms; the
gaps run from the claim to the record of the attempt's end (a lease not renewed while the
last of the history is copied can be taken over too). End to record: from the supervisor's
line "attempt 1: ENDING" to the agent's "attempt 1 ended", in the agent's log. Stored: the
points in the queue against those in the run's file.

    .venv/bin/python benchmarks/bench_lease_flood.py [--before OLD/src] [--rounds 1]
        [--seconds 8] [--kinds sqlite,postgres] [--pg URL] [--cases short,default]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from _common import machine, median, table
from bench_status import database, postgres

ROOT = Path(__file__).resolve().parent.parent
CASES = {"short": (0.5, 3.0), "default": (10.0, 60.0)}
FLOOD = """
import sys, time
import preemptible
seconds, metrics = float(sys.argv[1]), int(sys.argv[2])
names = [f"metric_{i:03d}" for i in range(metrics)]
until, step = time.monotonic() + seconds, 0
while time.monotonic() < until:
    preemptible.report(step=step, **{n: step + i / 1000 for i, n in enumerate(names)})
    step += 1
"""
# Run with the implementation's PYTHONPATH: the points stored for the sweep's one run.
COUNT = """
import sys
from preemptible.sweeps.store._queue import open_store
with open_store(sys.argv[1], create=False) as store:
    (run,) = store.runs(sys.argv[2])
    print(sum(len(p) for p in store.run_history(run.id).values()))
"""
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def stamp(line: str) -> float | None:
    match = _STAMP.match(line)
    if match is None:
        return None
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def watch(path: Path, stop: threading.Event, seen: list[float]) -> None:
    """Every deadline ``lease.json`` held, as wall time (polled every 10 ms)."""
    last = None
    while not stop.is_set():
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            doc = None
        if doc is not None and doc["deadline_monotonic"] != last:
            last = doc["deadline_monotonic"]
            seen.append(doc["deadline_monotonic"] - time.monotonic() + time.time())
        stop.wait(0.01)


def count_reported(path: Path) -> int:
    points = 0
    with path.open("rb") as fh:
        for line in fh:
            if line.endswith(b"\n"):
                points += len(json.loads(line)["values"])
    return points


def one(src: Path, url: str, case: str, seconds: float, metrics: int, tmp: Path) -> dict[str, Any]:
    heartbeat, lease = CASES[case]
    env = {**os.environ, "PYTHONPATH": str(src)}
    work = Path(tempfile.mkdtemp(dir=tmp))
    (work / "flood.py").write_text(FLOOD)
    spec = {
        "program": str(work / "flood.py"),
        "method": "grid",
        "parameters": {"x": {"value": 1}},
        "command": ["${interpreter}", "${program}", str(seconds), str(metrics)],
        "max_failures": 0,
    }
    (work / "spec.json").write_text(json.dumps(spec))
    py = [sys.executable, "-m", "preemptible"]
    made = subprocess.run(
        [*py, "sweep", "create", "spec.json", "--db", url],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    sweep = made.stdout.split()[-1]
    times = ["--heartbeat", f"{heartbeat:g}", "--lease", f"{lease:g}"]
    agent = subprocess.Popen(
        [*py, "agent", sweep, "--db", url, *times, "--count", "1"],
        cwd=work,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        runs = work / ".preemptible" / "runs"
        deadline = time.monotonic() + 60
        while not list(runs.glob("*/attempt-1/lease.json")) and time.monotonic() < deadline:
            time.sleep(0.005)  # the lease file of the run it claimed
        (lease_file,) = runs.glob("*/attempt-1/lease.json")
        stop, deadlines = threading.Event(), []
        watcher = threading.Thread(target=watch, args=(lease_file, stop, deadlines))
        watcher.start()
        _, log = agent.communicate(timeout=600)
        stop.set()
        watcher.join()
    finally:
        if agent.poll() is None:  # the benchmark failed or was stopped: so does the agent
            agent.terminate()
            agent.wait(120)
    ended = next(stamp(ln) for ln in log.splitlines() if re.search(r"attempt 1: [A-Z]+ \(", ln))
    recorded = next(stamp(ln) for ln in log.splitlines() if "attempt 1 ended" in ln)
    assert ended is not None and recorded is not None, log
    span = lease - 0.2 * lease  # deadline = renewal + lease - margin (LEASE_MARGIN 0.2)
    renewals = [d - span for d in deadlines] + [recorded]
    gaps = sorted(b - a for a, b in itertools.pairwise(renewals))
    stored = subprocess.run(
        [sys.executable, "-c", COUNT, url, sweep],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {
        "worst": gaps[-1],
        "p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        "stopped": "has not been renewed" in log or "took the run over" in log,
        "to_record": recorded - ended,
        "stored": int(stored),
        "reported": count_reported(lease_file.parent / "history.jsonl"),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", type=Path, help="an older tree's src, run beside this one")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--metrics", type=int, default=500)
    p.add_argument("--kinds", default="sqlite,postgres")
    p.add_argument("--cases", default="short,default")
    p.add_argument("--pg", help="a PostgreSQL server's URL (default: start one here)")
    args = p.parse_args()
    sources = [("now", ROOT / "src")]
    if args.before is not None:
        sources.insert(0, ("before", args.before.resolve()))
    kinds, cases = args.kinds.split(","), args.cases.split(",")
    print(f"machine: {machine()}")
    print(f"flood: {args.metrics} metrics a step for {args.seconds:g} s, --count 1\n")
    results: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with postgres(args.pg if "postgres" in kinds else "unused") as server:
            for _ in range(args.rounds):
                for case in cases:
                    for kind in kinds:
                        for name, src in sources:
                            with database(kind, server, tmp) as url:
                                got = one(src, url, case, args.seconds, args.metrics, tmp)
                            results.setdefault((case, kind, name), []).append(got)
                            print(case, kind, name, got, flush=True)
    rows = []
    for (case, kind, name), got in results.items():
        heartbeat, lease = CASES[case]
        rows.append(
            [
                f"{heartbeat:g} s / {lease:g} s",
                "SQLite" if kind == "sqlite" else "PostgreSQL",
                name,
                f"{median([g['worst'] for g in got]):.2f} s",
                f"{median([g['p99'] for g in got]):.2f} s",
                f"{sum(g['stopped'] for g in got)}/{len(got)}",
                f"{median([g['to_record'] for g in got]):.1f} s",
                f"{median([g['stored'] / max(g['reported'], 1) for g in got]):.0%}",
            ]
        )
    print()
    header = ["heartbeat / lease", "database", "src", "worst gap", "p99 gap", "stopped"]
    print(table([*header, "end to record", "stored"], rows))


if __name__ == "__main__":
    main()
