"""Chaos run of the sweep queue: agents, runs and guardians killed and stopped at random.

Real agents (``preemptible agent``) run a sweep of ``tests/scripts/lease_train.py`` runs (no
torch: each step is one integer update, so a resumed run that ends with the value of a run
never stopped resumed exactly). While they work, every 0.3-1.5 s one of these happens:

- an agent is SIGKILLed (a new one is started in its place);
- an agent and its run's process group are SIGKILLed (the machine is gone);
- an agent is SIGSTOPped for 1-3 leases, then continued (Ctrl+Z, a frozen VM);
- a run's process group is SIGKILLed (a crash the run did not cause: its run is "injured");
- a guardian is SIGKILLed, then its agent (the run is left without a supervisor);
- once, when a third of the runs are done: the database restarts (PostgreSQL only).

At the end (every run in a final state, or the deadline): **lost** runs not FINISHED (an
injured run has a failure budget to be tried again); **doubled** runs whose steps ran in two
processes at once (from every step's process id and monotonic time) or that ran again after an
attempt that finished; **healthy FAILED** runs never injured that had an attempt counted as a
failure (FAILED or CRASHED) or ended so; **wrong** FINISHED runs whose
final value is not that of a run never stopped; **orphans** trainers still alive once every
agent is gone, **orphaned** trainers ever seen without their agent, and the longest one was seen
so (each look is 0.3-1.5 s apart).

    .venv/bin/python benchmarks/bench_chaos.py [--backend sqlite|postgres|both] [--agents 4]
        [--runs 40] [--steps 60] [--seed 1] [--deadline 600]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
PY = sys.executable
TRAIN = ROOT / "tests" / "scripts" / "lease_train.py"
PG = ROOT / "tests" / "services" / "postgres.sh"
HEARTBEAT, LEASE = 0.5, 4.0


@dataclass
class Result:
    backend: str
    agents: int
    runs: int
    seconds: float = 0.0
    actions: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    lost: list[str] = field(default_factory=list)
    doubled: list[str] = field(default_factory=list)
    healthy_failed: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    orphans: int = 0
    orphaned: int = 0
    orphan_seconds: float = 0.0  # the longest a trainer was seen alive without its agent
    injured: set[str] = field(default_factory=set)
    states: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def as_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "agents": self.agents,
            "runs": self.runs,
            "seconds": round(self.seconds, 1),
            "actions": dict(self.actions),
            "states": dict(self.states),
            "lost": self.lost,
            "doubled": self.doubled,
            "healthy_failed": self.healthy_failed,
            "wrong": self.wrong,
            "orphans": self.orphans,
            "orphaned": self.orphaned,
            "orphan_seconds": round(self.orphan_seconds, 1),
            "injured": sorted(self.injured),
        }


# -- processes ---------------------------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def processes(marker: str) -> dict[int, int]:
    """pid -> parent pid of the live processes whose command line contains ``marker``."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields and fields[0] != "Z" and marker in _cmdline(int(entry)):
                found[int(entry)] = int(fields[1])
    return found


def _knows_crash_loops() -> bool:
    helptext = subprocess.run(
        [PY, "-m", "preemptible", "agent", "--help"], capture_output=True, text=True
    ).stdout
    return "--max-consecutive-failures" in helptext


class Agents:
    """``count`` agents kept alive; each in a session of its own, its output in a file."""

    def __init__(self, count: int, url: str, sweep: str, work: Path) -> None:
        self.count, self.url, self.sweep, self.work = count, url, sweep, work
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stopped: dict[int, float] = {}  # pid -> when to continue it (monotonic)
        self.started = 0

    def start(self) -> None:
        self.started += 1
        log = open(self.work / f"agent-{self.started}.log", "wb")  # noqa: SIM115
        args = [PY, "-m", "preemptible", "agent", self.sweep, "--db", self.url]
        args += ["--heartbeat", f"{HEARTBEAT:g}", "--lease", f"{LEASE:g}"]
        args += ["--home", str(self.work / "home")]
        if _knows_crash_loops():  # 0: never stop (a version without the option never does)
            args += ["--max-consecutive-failures", "0"]
        env = {**os.environ, "PREEMPTIBLE_DB_RETRY_TIMEOUT": "120"}
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.work,
            env=env,
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)

    def alive(self) -> list[subprocess.Popen[bytes]]:
        self.procs = [p for p in self.procs if p.poll() is None]
        return self.procs

    def keep(self, more: bool) -> None:
        """Continue agents whose stop is over; start new ones while runs remain."""
        now = time.monotonic()
        for pid, until in list(self.stopped.items()):
            if now >= until:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                del self.stopped[pid]
        while more and len(self.alive()) < self.count:
            self.start()

    def pids(self) -> set[int]:
        return {p.pid for p in self.alive()}

    def close(self) -> None:
        for pid in list(self.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped.clear()
        deadline = time.monotonic() + 60
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.2)  # they exit once nothing is left: not a synchronisation
        for proc in self.alive():
            proc.terminate()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)


# -- databases ---------------------------------------------------------------------------------
@contextlib.contextmanager
def database(backend: str, work: Path) -> Iterator[tuple[str, str | None]]:
    """(URL of an empty database, the PostgreSQL directory for restarts or None)."""
    if backend == "sqlite":
        yield f"sqlite://{work / 'sweeps.db'}", None
        return
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp"
    directory = tempfile.mkdtemp(prefix="preemptible-chaos-pg-", dir=base)
    try:
        up = subprocess.run(["bash", str(PG), "up", directory], capture_output=True, text=True)
        if up.returncode:
            raise SystemExit(f"could not start PostgreSQL: {up.stderr.strip()}")
        import psycopg

        server = up.stdout.strip()
        name = f"chaos_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
        yield server.rsplit("/", 1)[0] + f"/{name}", directory
    finally:
        subprocess.run(["bash", str(PG), "down", directory], capture_output=True)


# -- one chaos run -----------------------------------------------------------------------------
def chaos(
    backend: str,
    *,
    agents: int,
    runs: int,
    steps: int,
    step_sleep: float,
    seed: int,
    deadline: float,
    work: Path,
    actions: int = 10**9,
) -> Result:
    """One chaos run; ``actions``: how many to take (each kind in turn, in a random order, then
    at random), after which the agents are left to finish in peace."""
    from lease_train import expected

    from preemptible.sweeps.store._queue import open_store

    rng = random.Random(seed)
    result = Result(backend, agents, runs)
    log = work / "steps.log"
    lengths = {i: steps + i for i in range(runs)}
    spec = {
        "program": str(TRAIN),
        "method": "grid",
        "parameters": {
            "steps": {"values": list(lengths.values())},
            "step-sleep": {"value": step_sleep},
            "log": {"value": str(log)},
        },
        "max_failures": 1000,  # an injured run is tried again; a healthy one never fails
        "max_preemptions": 1000,
    }
    (work / "spec.yaml").write_text(json.dumps(spec))
    with database(backend, work) as (url, pg_dir):
        made = subprocess.run(
            [PY, "-m", "preemptible", "sweep", "create", str(work / "spec.yaml"), "--db", url],
            capture_output=True,
            text=True,
            cwd=work,
            check=True,
        )
        sweep = made.stdout.strip().splitlines()[-1]
        store = open_store(url, retry_timeout=120)
        crew = Agents(agents, url, sweep, work)
        marker = str(log)  # in every trainer's command line
        started = time.monotonic()
        restarted = pg_dir is None
        orphaned: dict[int, list[float]] = {}  # pid -> [first, last] seen without its agent
        try:
            while True:
                rows = store.runs(sweep)
                final = [r for r in rows if r.state not in ("PENDING", "RUNNING")]
                if len(final) == runs or time.monotonic() - started > deadline:
                    break
                crew.keep(more=True)
                trainers = processes(marker)
                live = crew.pids()
                now = time.monotonic()
                for pid, parent in trainers.items():
                    if parent not in live:
                        orphaned.setdefault(pid, [now, now])[1] = now
                if not restarted and len(final) >= runs // 3:
                    restarted = True
                    subprocess.run(["bash", str(PG), "restart", str(pg_dir)], check=True)
                    result.actions["database restart"] += 1
                if sum(result.actions.values()) < actions:
                    act(rng, crew, trainers, result)
                time.sleep(rng.uniform(0.3, 1.5))  # the chaos's own pace
        finally:
            result.seconds = time.monotonic() - started
            crew.close()
            time.sleep(LEASE * 2)  # orphans have a lease to go by themselves: then counted
            left = processes(marker)
            result.orphans = len(left)
            result.orphaned = len(orphaned)
            result.orphan_seconds = max((b - a for a, b in orphaned.values()), default=0.0)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        judge(result, store, sweep, log, work / "home", lengths, expected)
        store.close()
    return result


def act(rng: random.Random, crew: Agents, trainers: dict[int, int], result: Result) -> None:
    running = [p for p in crew.alive() if p.pid not in crew.stopped]
    if not running:
        return
    victim = rng.choice(running)
    mine = [pid for pid, parent in trainers.items() if parent == victim.pid]
    done = sum(n for k, n in result.actions.items() if k in KINDS)
    if done < len(KINDS):  # each kind once first, in a random order
        action = _next_kind(result, rng)
    else:
        action = rng.choices(KINDS, weights=[2, 1, 2, 1, 1])[0]
    if action in ("kill run", "kill machine") and not mine:
        action = "kill agent"
    if action == "kill agent":
        os.kill(victim.pid, signal.SIGKILL)
    elif action == "kill machine":
        for pid in mine:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        os.kill(victim.pid, signal.SIGKILL)
    elif action == "stop agent":
        os.kill(victim.pid, signal.SIGSTOP)
        crew.stopped[victim.pid] = time.monotonic() + rng.uniform(1, 3) * LEASE
    elif action == "kill run":
        for pid in mine:
            run = _run_of(pid)
            if run:
                result.injured.add(run)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    else:
        guardians = [
            pid
            for pid, parent in processes("preemptible.supervisor._guard").items()
            if parent == victim.pid
        ]
        for pid in guardians:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.kill(victim.pid, signal.SIGKILL)
    result.actions[action] += 1


KINDS = ["kill agent", "kill machine", "stop agent", "kill run", "kill guardian, then agent"]


def _next_kind(result: Result, rng: random.Random) -> str:
    left = [k for k in KINDS if not result.actions.get(k)]
    return rng.choice(left) if left else rng.choice(KINDS)


def _run_of(pid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"PREEMPTIBLE_RUN_ID="):
            return item.split(b"=", 1)[1].decode()
    return None


def judge(
    result: Result,
    store: Any,
    sweep: str,
    log: Path,
    home: Path,
    lengths: dict[int, int],
    expected: Any,
) -> None:
    spans: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for line in log.read_text().splitlines() if log.exists() else []:
        run, pid, at, _ = line.split()
        spans[run][int(pid)].append(float(at))
    for row in store.runs(sweep):
        result.states[row.state] += 1
        attempts = store.attempts(row.id)
        injured = row.id in result.injured
        if row.state != "FINISHED":
            result.lost.append(row.id)
        if not injured and (row.failures or row.state in ("FAILED", "CRASHED")):
            result.healthy_failed.append(row.id)
        ordered = sorted((min(t), max(t)) for t in spans[row.id].values())
        overlap = any(a[1] >= b[0] for a, b in itertools.pairwise(ordered))
        again = any(a.ending == "FINISHED" for a in attempts[:-1])
        if overlap or again:
            result.doubled.append(row.id)
        if row.state == "FINISHED":
            try:
                x = json.loads((home / "runs" / row.id / "final.json").read_text())["x"]
            except (OSError, ValueError, KeyError):
                x = None
            if x != expected(lengths[row.index]):
                result.wrong.append(row.id)


def main() -> int:
    from _common import machine, table

    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--runs", type=int, default=40)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--deadline", type=float, default=900.0)
    p.add_argument("--actions", type=int, default=120, help="then the agents finish in peace")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    backends = ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    results = []
    for backend in backends:
        with tempfile.TemporaryDirectory(prefix="preemptible-chaos-") as work:
            results.append(
                chaos(
                    backend,
                    agents=args.agents,
                    runs=args.runs,
                    steps=args.steps,
                    step_sleep=args.step_sleep,
                    seed=args.seed,
                    deadline=args.deadline,
                    work=Path(work),
                    actions=args.actions,
                )
            )
    if args.json:
        print(json.dumps([r.as_json() for r in results], indent=1))
        return 0
    print(machine())
    print(
        table(
            [
                "backend",
                "agents",
                "runs",
                "s",
                "actions",
                "lost",
                "doubled",
                "healthy FAILED",
                "wrong",
                "orphans",
                "orphaned (longest s)",
            ],
            [
                [
                    r.backend,
                    r.agents,
                    r.runs,
                    f"{r.seconds:.0f}",
                    ", ".join(f"{k} {v}" for k, v in sorted(r.actions.items())),
                    len(r.lost),
                    len(r.doubled),
                    len(r.healthy_failed),
                    len(r.wrong),
                    r.orphans,
                    f"{r.orphaned} ({r.orphan_seconds:.1f})",
                ]
                for r in results
            ],
        )
    )
    bad = any(r.lost or r.doubled or r.healthy_failed or r.wrong or r.orphans for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
