"""``preemptible status`` of a large sweep: wall time and peak memory, table against --json.

A sweep of N runs is laid out through the store (``create_sweep`` + ``add_runs``), then given
a realistic history by bulk SQL: most runs FINISHED (some after a preemption), some FAILED,
PREEMPTED and back in the queue, RUNNING, and the rest PENDING; each attempt a row, each
finished or running run a summary. Then ``preemptible status SWEEP_ID`` (the table, into a
pipe), ``status SWEEP_ID --json`` and ``status`` (the list of sweeps) run as fresh processes,
interleaved (the order rotated each round); reported: median wall time and the largest peak
RSS (``wait4``'s ru_maxrss) of each.

PostgreSQL is a throwaway server started with tests/services/postgres.sh (fsync off), unless
--pg-url names one (a database in it is created and dropped).

    .venv/bin/python benchmarks/bench_status.py [--runs 100000] [--repeats 3]
        [--kinds sqlite,postgres] [--before OLD/src]   # and another version, interleaved
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
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import machine, median, table

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SPEC: dict[str, Any] = {
    "program": "train.py",
    "method": "random",
    "metric": {"name": "val_loss", "goal": "minimize"},
    "parameters": {
        "lr": {"distribution": "log_uniform_values", "min": 1e-5, "max": 1e-1},
        "batch": {"values": [32, 64, 128, 256]},
        "model": {"parameters": {"depth": {"min": 2, "max": 12}, "act": {"values": ["relu"]}}},
    },
}


@contextlib.contextmanager
def postgres(url: str | None) -> Iterator[str]:
    """The URL of a PostgreSQL server: the given one, or a throwaway one started here."""
    if url:
        yield url
        return
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp"
    directory = tempfile.mkdtemp(prefix="preemptible-bench-pg-", dir=base)
    script = str(ROOT / "tests" / "services" / "postgres.sh")
    try:
        up = subprocess.run(["bash", script, "up", directory], capture_output=True, text=True)
        if up.returncode:
            raise SystemExit(f"could not start PostgreSQL: {up.stderr.strip()}")
        yield up.stdout.strip()
    finally:
        subprocess.run(["bash", script, "down", directory], capture_output=True)


@contextlib.contextmanager
def database(kind: str, server: str | None, tmp: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite://{tmp / uuid.uuid4().hex}.db"
        return
    import psycopg

    assert server is not None
    name = f"bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
    try:
        yield server.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')  # type: ignore[arg-type]


def build(url: str, runs: int, seed: int = 0) -> str:
    """A sweep of ``runs`` runs with a history; its id."""
    from preemptible.sweeps.store._queue import open_store

    rng = random.Random(seed)
    with open_store(url) as store:
        sweep = store.create_sweep(
            SPEC, name="big", run_cap=None, max_failures=1, max_preemptions=5
        )
        params = [
            {
                "lr": 10 ** rng.uniform(-5, -1),
                "batch": rng.choice([32, 64, 128, 256]),
                "model": {"depth": rng.randint(2, 12), "act": "relu"},
            }
            for _ in range(runs)
        ]
        for start in range(0, runs, 20_000):
            store.add_runs(sweep, params[start : start + 20_000])
        kind = store.kind
    t0 = 1.7e9
    run_rows: list[tuple[Any, ...]] = []
    attempt_rows: list[tuple[Any, ...]] = []
    for i in range(runs):
        run_id = f"{sweep}-{i}"
        u = rng.random()
        start = t0 + i * 3.0
        if u < 0.02 and i >= runs - runs // 20:  # pending: never claimed (the newest)
            continue
        # (ending of each attempt, the run's state)
        if u < 0.85:
            endings, state = ["FINISHED"], "FINISHED"
        elif u < 0.90:
            endings, state = ["PREEMPTED", "FINISHED"], "FINISHED"
        elif u < 0.94:
            endings, state = ["FAILED", "FAILED"], "FAILED"
        elif u < 0.97:
            endings, state = ["PREEMPTED"], "PENDING"
        elif u < 0.99:
            endings, state = ["PREEMPTED", None], "RUNNING"
        else:
            endings, state = ["CRASHED", "CRASHED"], "CRASHED"
        at = start
        for number, ending in enumerate(endings, 1):
            length = rng.uniform(60, 3600)
            ended = None if ending is None else at + length
            attempt_rows.append(
                (
                    *(run_id, number, f"agent-{rng.randrange(64)}", f"node{rng.randrange(16)}"),
                    *(
                        at,
                        ended,
                        ending,
                        None if ending is None else (0 if ending == "FINISHED" else 1),
                    ),
                    *(None if ending is None else length, rng.randrange(10_000), 0),
                    None if ending is None else ("PENDING" if number < len(endings) else state),
                    None if ending is None else "agent",
                )
            )
            at += length + 5
        summary = None
        if state in ("FINISHED", "RUNNING") or rng.random() < 0.5:
            summary = json.dumps(
                {"val_loss": rng.uniform(0.1, 2.0), "acc": rng.random(), "step": 9999}
            )
        running = state == "RUNNING"
        run_rows.append(
            (
                state,
                len(endings),
                endings.count("PREEMPTED"),
                endings.count("FAILED") + endings.count("CRASHED"),
                "agent" if running else None,
                "node0" if running else None,
                at + 60 if running else None,
                summary,
                at,
                run_id,
            )
        )
    update = (
        "UPDATE preemptible_runs SET state = {p}, attempt = {p}, preemptions = {p}, "
        "failures = {p}, lease_owner = {p}, lease_host = {p}, lease_expires = {p}, "
        "summary = {p}, updated_at = {p} WHERE id = {p}"
    )
    insert = (
        "INSERT INTO preemptible_attempts (run_id, number, agent, host, started_at, ended_at, "
        "ending, exit_code, duration, checkpoint_step, marked_preempting, outcome, closed_by) "
        "VALUES ({0})"
    )
    if kind == "sqlite":
        import sqlite3

        path = url[len("sqlite://") :]
        with contextlib.closing(sqlite3.connect(path)) as conn, conn:
            conn.executemany(update.format(p="?"), run_rows)
            conn.executemany(insert.format(", ".join("?" * 13)), attempt_rows)
    else:
        import psycopg

        with psycopg.connect(url) as conn, conn.cursor() as cur:
            cur.executemany(update.format(p="%s"), run_rows)
            with cur.copy(
                "COPY preemptible_attempts (run_id, number, agent, host, started_at, ended_at, "
                "ending, exit_code, duration, checkpoint_step, marked_preempting, outcome, "
                "closed_by) FROM STDIN"
            ) as copy:
                for row in attempt_rows:
                    copy.write_row(row)
    return sweep


def measure(args: list[str], src: str | None, *, cwd: Path) -> tuple[float, float, int, float]:
    """(seconds, peak RSS in MiB, bytes written, CPU seconds) of one ``preemptible`` process
    (``src``: the source tree to run it from, another version's ``src`` folder). CPU time is
    the steadier number on a shared machine: others' load stretches the wall time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
    if src:
        env["PYTHONPATH"] = src
    with tempfile.TemporaryFile() as out:
        started = time.perf_counter()
        proc = subprocess.Popen(
            [PY, "-m", "preemptible", *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.PIPE
        )
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - started
        assert proc.stderr is not None
        err = proc.stderr.read().decode()
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"preemptible {' '.join(args)} exited {proc.returncode}: {err}")
        size = out.tell()
    return elapsed, usage.ru_maxrss / 1024, size, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default="sqlite,postgres")
    parser.add_argument("--pg-url", help="an existing server (postgresql://...)")
    parser.add_argument(
        "--before", metavar="SRC", help="also run another version (its src folder), interleaved"
    )
    parser.add_argument("--build", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build:
        print(build(args.build, args.runs))
        return
    kinds = args.kinds.split(",")
    versions: list[tuple[str, str | None]] = [("", None)]
    if args.before:
        versions.append((" (before)", args.before))
    rows = []
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(postgres(args.pg_url)) if "postgres" in kinds else None
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for kind in kinds:
            url = stack.enter_context(database(kind, server, tmp))
            started = time.perf_counter()
            # built in a child: a process started from a big parent inherits its peak RSS
            sweep = subprocess.run(
                [PY, __file__, "--build", url, "--runs", str(args.runs)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()[-1]
            print(f"{kind}: built {args.runs} runs in {time.perf_counter() - started:.1f} s")
            commands = {
                f"{what}{label}": (args_, src)
                for what, args_ in (
                    ("table", ["status", sweep, "--db", url]),
                    ("--json", ["status", sweep, "--db", url, "--json"]),
                    ("list", ["status", "--db", url]),
                )
                for label, src in versions
            }
            results: dict[str, list[tuple[float, float, int, float]]] = {n: [] for n in commands}
            names = list(commands)
            for repeat in range(args.repeats):
                for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                    results[name].append(measure(*commands[name], cwd=tmp))
            for name, got in results.items():
                rows.append(
                    (
                        kind,
                        name,
                        f"{median([g[0] for g in got]):.2f} s",
                        f"{median([g[3] for g in got]):.2f} s",
                        f"{max(g[1] for g in got):.0f} MiB",
                        f"{got[-1][2] / 1e6:.1f} MB",
                    )
                )
            cpu = {name: median([g[3] for g in got]) for name, got in results.items()}
            print(f"  --json / table (CPU): {cpu['--json'] / cpu['table']:.2f}", flush=True)
    # machine() imports torch: only now, as a child started from a big parent inherits its peak
    print(f"\nmachine: {machine()}")
    print(f"\n`preemptible status` of a {args.runs:,}-run sweep (median of {args.repeats})\n")
    print(table(["backend", "status", "wall", "CPU", "peak RSS", "output"], rows))


if __name__ == "__main__":
    main()
