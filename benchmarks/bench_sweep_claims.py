"""The sweep queue's throughput and recovery, on SQLite and on PostgreSQL.

Claims: 1, 4 and 8 agent processes take pre-created runs from one sweep as fast as they can
(claim, then finish FINISHED: a whole run's worth of queue work, no training); runs per second
from the moment all agents are released to the moment the last one is done.

Recovery: an agent claims a run with a short lease and vanishes; a second agent, "on another
host" (it cannot see the first one's process), calls ``claim`` every 10 ms. Reported: the time
from the lease's expiry to the run's next attempt starting, both read from the database clock
(no clock skew between processes in it), and that time less the takeover margin (20 % of the
lease, during which the lost agent's run must already be gone; none before leases had one).
A real agent polls less often: add its polling interval.

PostgreSQL is a throwaway server started with tests/services/postgres.sh (fsync off, as in
the tests), unless --pg-url names one (a database in it is created and dropped).

    .venv/bin/python benchmarks/bench_sweep_claims.py [--runs 600] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from _common import machine, median, table

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
AGENT = r"""
import sys, time
from pathlib import Path
from preemptible.sweeps.store._queue import open_store
url, sweep, name, go = sys.argv[1:5]
store = open_store(url)
print("ready", flush=True)
while not Path(go).exists():
    time.sleep(0.001)
start, done = time.time(), 0
while (c := store.claim(sweep, agent=name, host="bench", lease=60, propose=None)) is not None:
    store.finish(c.run_id, agent=name, attempt=c.attempt, ending="FINISHED", exit_code=0,
                 duration=0.0, checkpoint_step=None, summary=None)
    done += 1
print(f"{start} {time.time()} {done}", flush=True)
"""


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
def database(kind: str, server: str, tmp: Path) -> Iterator[str]:
    """A fresh, empty database of that kind."""
    if kind == "sqlite":
        path = tmp / f"{uuid.uuid4().hex}.db"
        yield f"sqlite://{path}"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        return
    import psycopg

    name = f"bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
    try:
        yield server.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')  # type: ignore[arg-type]


def claims_per_second(url: str, agents: int, runs: int, tmp: Path) -> float:
    from preemptible.sweeps.store._queue import open_store

    with open_store(url) as store:
        sweep = store.create_sweep(
            {}, name="bench", run_cap=None, max_failures=0, max_preemptions=0
        )
        store.add_runs(sweep, [{"i": i} for i in range(runs)])
    go = tmp / f"go-{uuid.uuid4().hex}"
    procs = [
        subprocess.Popen(
            [PY, "-c", AGENT, url, sweep, f"agent-{n}", str(go)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(agents)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    go.touch()
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0
        start, end, done = out.split()
        results.append((float(start), float(end), int(done)))
    go.unlink()
    assert sum(done for _, _, done in results) == runs
    return runs / (max(e for _, e, _ in results) - min(s for s, _, _ in results))


def requeue_latency(url: str) -> float:
    """Seconds from a lost agent's lease expiry to the run's next attempt starting."""
    from preemptible.sweeps.store._queue import open_store

    with open_store(url) as lost, open_store(url) as rescuer:
        sweep = lost.create_sweep({}, name="bench", run_cap=None, max_failures=0, max_preemptions=5)
        [run_id] = lost.add_runs(sweep, [{"i": 0}])
        assert lost.claim(sweep, agent="lost", host="a", lease=0.5, propose=None) is not None
        expires = lost.run(run_id).lease_expires  # then "lost" sends no heartbeat
        assert expires is not None
        while rescuer.claim(sweep, agent="rescuer", host="b", lease=60, propose=None) is None:
            time.sleep(0.01)  # a polling agent
        first, second = rescuer.attempts(run_id)
        assert first.closed_by == "(lease expired)" and second.agent == "rescuer"
        return second.started_at - expires


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=600, help="runs per throughput measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--recoveries", type=int, default=9)
    parser.add_argument("--pg-url", help="an existing server (postgresql://...)")
    args = parser.parse_args()
    logging.getLogger("preemptible").setLevel(logging.ERROR)  # "run ... lost its agent"
    print(f"machine: {machine()}\n")
    with postgres(args.pg_url) as server, tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        throughput = []
        for kind in ("sqlite", "postgres"):
            for agents in (1, 4, 8):
                rates = []
                for _ in range(args.repeats):
                    with database(kind, server, tmp) as url:
                        rates.append(claims_per_second(url, agents, args.runs, tmp))
                throughput.append(
                    (kind, agents, f"{median(rates):.0f}", f"{min(rates):.0f}-{max(rates):.0f}")
                )
                print(f"  {kind} {agents} agents: {[round(r) for r in rates]}", flush=True)
        recovery = []
        for kind in ("sqlite", "postgres"):
            waits = []
            for _ in range(args.recoveries):
                with database(kind, server, tmp) as url:
                    waits.append(requeue_latency(url))
            margin = _margin(0.5)
            past = [w - margin for w in waits]
            recovery.append(
                (
                    kind,
                    f"{median(waits) * 1000:.0f} ms",
                    f"{max(waits) * 1000:.0f} ms",
                    f"{margin * 1000:.0f} ms",
                    f"{median(past) * 1000:.0f} ms",
                )
            )
    print(f"\nclaim + finish, runs/s (median of {args.repeats}, {args.runs} runs each)\n")
    print(table(["backend", "agents", "runs/s", "range"], throughput))
    print(f"\nlease expired -> run claimed again, 10 ms polling (median of {args.recoveries})\n")
    print(table(["backend", "median", "max", "margin", "median past the margin"], recovery))


def _margin(lease: float) -> float:
    """The takeover margin of this version (0 before leases had one)."""
    from preemptible.sweeps.store import _queue

    return float(getattr(_queue, "LEASE_MARGIN", 0.0)) * lease


if __name__ == "__main__":
    main()
