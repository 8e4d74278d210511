"""Hyperband's judge on a sweep with long metric histories: the seconds one check takes.

An agent asks its judge after every heartbeat of its run (``sweeps/_early.py``): it reads the
sweep's stored points of the metric and W&B's decision for its own run. The sweep here has
``--runs`` runs of ``--points`` points each (built by bulk SQL; the values are a noisy
decreasing loss), and ``early_terminate: {type: hyperband, min_iter: 3, eta: 3}``; the run
judged is a running one with the full history. Each implementation (this tree's ``src``, and
``--before OLD/src`` when given) is timed in a process of its own, checks interleaved, on the
same database file.

    .venv/bin/python benchmarks/bench_judge.py [--runs 200] [--points 5000] [--repeats 7]
        [--before OLD/src] [--kinds sqlite,postgres] [--pg URL]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import machine, median, table
from bench_status import database, postgres

ROOT = Path(__file__).resolve().parent.parent
SPEC = {
    "program": "train.py",
    "method": "random",
    "metric": {"name": "loss", "goal": "minimize"},
    "parameters": {"lr": {"distribution": "log_uniform_values", "min": 1e-5, "max": 1e-1}},
    "early_terminate": {"type": "hyperband", "min_iter": 3, "eta": 3},
}

# Runs in a process of its own with PYTHONPATH set to the implementation's src: prints the
# median seconds of a check, and the decision (the same in every implementation).
TIMER = """
import json, sys, time
from preemptible.sweeps.agent._early import Judge
from preemptible.sweeps.spec._spec import parse_spec
from preemptible.sweeps.store._queue import open_store
url, sweep, run, repeats = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with open_store(url, create=False) as store:
    spec = parse_spec(store.sweep(sweep).spec, source="bench")
    judge = Judge(spec, sweep, run)
    times, decision = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        decision = judge.check(store)
        times.append(time.perf_counter() - t0)
times.sort()
print(json.dumps({"median": times[len(times) // 2], "stop": decision is not None}))
"""


def build(url: str, runs: int, points: int, seed: int = 0) -> tuple[str, str]:
    """A sweep of ``runs`` runs with ``points`` points of ``loss`` each; (its id, the id of
    the running run to judge)."""
    from preemptible.sweeps.store._queue import open_store

    rng = random.Random(seed)
    with open_store(url) as store:
        sweep = store.create_sweep(
            SPEC, name="judge", run_cap=None, max_failures=1, max_preemptions=5
        )
        store.add_runs(sweep, [{"lr": 10 ** rng.uniform(-5, -1)} for _ in range(runs)])
        kind = store.kind
    rows = []
    for i in range(runs):
        base = rng.uniform(0.5, 2.0)
        for step in range(points):
            loss = base / (1 + step / 100) + rng.gauss(0, 0.01)
            rows.append((f"{sweep}-{i}", "loss", step, loss, 1))
    # the judged run: the last, running, and worse than most (the judge stops it)
    judged = f"{sweep}-{runs - 1}"
    insert = "INSERT INTO preemptible_history (run_id, name, step, value, attempt) VALUES ({})"
    mark = "UPDATE preemptible_runs SET state = 'RUNNING', attempt = 1 WHERE id = {p}"
    if kind == "sqlite":
        import sqlite3

        with contextlib.closing(sqlite3.connect(url[len("sqlite://") :])) as conn, conn:
            conn.executemany(insert.format(", ".join("?" * 5)), rows)
            conn.execute(mark.format(p="?"), (judged,))
    else:
        import psycopg

        with psycopg.connect(url) as conn, conn.cursor() as cur:
            with cur.copy(
                "COPY preemptible_history (run_id, name, step, value, attempt) FROM STDIN"
            ) as copy:
                for row in rows:
                    copy.write_row(row)
            cur.execute(mark.format(p="%s"), (judged,))
    return sweep, judged


def check(src: Path, url: str, sweep: str, run: str, repeats: int) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", TIMER, url, sweep, run, str(repeats)],
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--points", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--before", type=Path, help="an older tree's src, timed beside this one")
    parser.add_argument("--kinds", default="sqlite,postgres")
    parser.add_argument("--pg", help="a PostgreSQL server URL (else one is started here)")
    args = parser.parse_args()
    sources = [("this tree", ROOT / "src")]
    if args.before is not None:
        sources.insert(0, ("before", args.before.resolve()))
    kinds = args.kinds.split(",")
    print(f"machine: {machine()}")
    print(f"{args.runs} runs x {args.points} points, {args.repeats} checks each, medians\n")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        server = stack.enter_context(postgres(args.pg)) if "postgres" in kinds else None
        for kind in kinds:
            url = stack.enter_context(database(kind, server, Path(tmp)))
            sweep, run = build(url, args.runs, args.points)
            found: dict[str, list[float]] = {name: [] for name, _ in sources}
            stops: set[object] = set()
            for _ in range(3):  # rounds, the implementations interleaved
                for name, src in sources:
                    result = check(src, url, sweep, run, args.repeats)
                    found[name].append(float(result["median"]))  # type: ignore[arg-type]
                    stops.add(result["stop"])
            assert len(stops) == 1, f"the implementations disagree: {stops}"
            first = median(found[sources[0][0]])
            for name, _ in sources:
                seconds = median(found[name])
                rows.append((kind, name, f"{seconds * 1000:.1f} ms", f"{seconds / first:.2f}"))
    print(table(("database", "judge", "one check", "ratio"), rows))


if __name__ == "__main__":
    main()
