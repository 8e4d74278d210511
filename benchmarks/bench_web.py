"""``preemptible status SWEEP --serve`` of a large sweep: how long its pages take to load.

The sweep is the one of bench_status.py (N runs with a history of attempts and summaries,
built by bulk SQL). The server runs as the CLI, in its own process; each request is timed
from sending it to the last byte received (server time and transfer, on this machine), a
fresh connection each time, the routes interleaved round by round:

* ``start``: from starting the command to its "serving" line (it reads the whole sweep once);
* ``/``, ``/api/sweep``, ``/best.svg``, ``/timeline.svg``: the sweep's page, its data (what
  the page reads every 2 s), its charts; ``/plot.png``: the matplotlib timeline of the
  table's page of runs (not on the page);
* ``/?state=RUNNING&page=2``: a filtered page; ``/run/ID``: a run's page;
* ``/api/sweep, N running runs changed``: the data again after a heartbeat of every running
  run (2 % of them), which the server reads again;
* ``browser``: with chromium, the whole page in a headless browser (``load`` event: the
  HTML, its chart and the timeline picture).

Also: the server's CPU seconds per ``/api/sweep`` while nothing changes (an open page, idle).

    .venv/bin/python benchmarks/bench_web.py [--runs 100000] [--repeats 7] [--kinds sqlite]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from _common import machine, median, table
from bench_status import database, postgres

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
CHROMIUM = "/usr/bin/chromium"


@contextlib.contextmanager
def serving(url: str, sweep: str) -> Iterator[tuple[str, float, int]]:
    """(the page's address, seconds to the "serving" line, the server's pid)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    started = time.perf_counter()
    proc = subprocess.Popen(
        [PY, "-m", "preemptible", "status", sweep, "--db", url, "--serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    out = proc.stdout
    threading.Thread(target=lambda: [lines.put(line) for line in out], daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=300)
            found = re.search(r"at (http://\S+/)", line)
            if found:
                break
        yield found.group(1), time.perf_counter() - started, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def fetch(address: str, path: str) -> tuple[float, int]:
    """(seconds to the last byte, bytes) of one GET."""
    started = time.perf_counter()
    with urllib.request.urlopen(address.rstrip("/") + path, timeout=60) as r:
        body = r.read()
        assert r.status == 200, (path, r.status)
    return time.perf_counter() - started, len(body)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def touch_running(url: str, sweep: str) -> int:
    """A heartbeat of every running run (bulk SQL, as agents would write them): their
    ``updated_at`` moves, as the live page sees it. How many."""
    now = time.time()
    if url.startswith("sqlite"):
        import sqlite3

        with contextlib.closing(sqlite3.connect(url[len("sqlite://") :])) as conn, conn:
            cur = conn.execute(
                "UPDATE preemptible_runs SET updated_at = ? WHERE sweep_id = ? AND state = ?",
                (now, sweep, "RUNNING"),
            )
            return cur.rowcount
    import psycopg

    with psycopg.connect(url) as conn:
        cur = conn.execute(
            "UPDATE preemptible_runs SET updated_at = %s WHERE sweep_id = %s AND state = %s",
            (now, sweep, "RUNNING"),
        )
        return cur.rowcount


def browser_load(address: str, repeats: int) -> list[float]:
    """Seconds to the ``load`` event of the page in headless chromium, each a fresh page."""
    from playwright.sync_api import sync_playwright

    times = []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        try:
            for _ in range(repeats):
                page = browser.new_page()
                started = time.perf_counter()
                page.goto(address, wait_until="load")
                times.append(time.perf_counter() - started)
                page.close()
        finally:
            browser.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kinds", default="sqlite")
    parser.add_argument("--pg-url", help="an existing server (postgresql://...)")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    rows = []
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(postgres(args.pg_url)) if "postgres" in kinds else None
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for kind in kinds:
            url = stack.enter_context(database(kind, server, tmp))
            sweep = subprocess.run(
                [
                    PY,
                    str(ROOT / "benchmarks" / "bench_status.py"),
                    "--build",
                    url,
                    "--runs",
                    str(args.runs),
                ],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            ).stdout.split()[-1]
            starts = []
            results: dict[str, list[tuple[float, int]]] = {}
            browser: list[float] = []
            idle_cpu: list[float] = []
            for repeat in range(max(1, args.repeats // 3)):
                with serving(url, sweep) as (address, start, pid):
                    starts.append(start)
                    paths = {
                        "/": "/",
                        "/api/sweep": "/api/sweep",
                        "/best.svg": "/best.svg",
                        "/timeline.svg": "/timeline.svg",
                        "/plot.png": "/plot.png",
                        "/?state=RUNNING&page=2": "/?state=RUNNING&page=2",
                        "/run/ID": f"/run/{sweep}-{args.runs // 2}",
                    }
                    names = list(paths)
                    for r in range(args.repeats):
                        turn = (r + repeat) % len(names)
                        for name in names[turn:] + names[:turn]:
                            results.setdefault(name, []).append(fetch(address, paths[name]))
                        touched = touch_running(url, sweep)
                        key = f"/api/sweep, {touched} running runs changed"
                        results.setdefault(key, []).append(fetch(address, "/api/sweep"))
                    before = cpu_seconds(pid)
                    for _ in range(20):
                        fetch(address, "/api/sweep")
                    idle_cpu.append((cpu_seconds(pid) - before) / 20)
                    if repeat == 0 and shutil.which(CHROMIUM):
                        with contextlib.suppress(ImportError):
                            browser = browser_load(address, args.repeats)
            rows.append((kind, "start (reads the whole sweep)", f"{median(starts):.2f} s", ""))
            for name, got in results.items():
                size = median([g[1] for g in got])
                rows.append(
                    (kind, name, f"{median([g[0] for g in got]):.3f} s", f"{size / 1e3:.0f} kB")
                )
            if browser:
                rows.append((kind, "browser: / to its load event", f"{median(browser):.3f} s", ""))
            rows.append(
                (
                    kind,
                    "server CPU per /api/sweep, nothing changed",
                    f"{median(idle_cpu):.3f} s",
                    "",
                )
            )
            print(f"{kind}: done", flush=True)
    print(f"\nmachine: {machine()}")
    print(f"\n`preemptible status --serve` of a {args.runs:,}-run sweep (medians)\n")
    print(table(["backend", "request", "time", "size"], rows))


if __name__ == "__main__":
    main()
