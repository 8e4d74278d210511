"""``preemptible status SWEEP --serve``: the real CLI as a child process, serving a real SQLite
sweep queue whose runs went through the Store API; read with urllib (and, where chromium is
installed, in a headless browser); stopped with real signals."""

from __future__ import annotations

import contextlib
import html
import http.client
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from preemptible.sweeps._store import Store, open_store

pytestmark = pytest.mark.timeout(120)

SRC = Path(__file__).resolve().parents[2] / "src"
SPEC: dict[str, Any] = {
    "method": "random",
    "metric": {"name": "loss", "goal": "minimize"},
    "parameters": {"lr": {"min": 0.001, "max": 0.1}},
}
EVIL = "<script>alert('x')</script>"
EVIL_PARAM = '"><svg onload=alert(1)>'  # within the cell's 24 characters
CHROMIUM = "/usr/bin/chromium"


def _sweep(store: Store) -> tuple[str, list[str]]:
    """Four runs: 0 FINISHED (loss 0.25), 1 RUNNING, 2 FAILED, 3 PENDING; hostile names."""
    sweep = store.create_sweep(SPEC, name=EVIL, run_cap=None, max_failures=0, max_preemptions=2)
    store.add_runs(sweep, [{"lr": 0.01}, {"lr": 0.02, "tag": EVIL_PARAM}, {"lr": 0.5}, {"lr": 0.1}])
    claims = []
    for i in range(3):
        c = store.claim(sweep, agent=f"a{i}", host="h", lease=600, propose=None)
        assert c is not None and c.index == i
        claims.append(c)
    done = {"exit_code": 0, "duration": 1.0, "checkpoint_step": 50, "summary": {"loss": 0.25}}
    assert store.finish(claims[0].run_id, agent="a0", attempt=1, ending="FINISHED", **done)
    failed = {"exit_code": 1, "duration": 1.0, "checkpoint_step": None, "summary": None}
    assert store.finish(claims[2].run_id, agent="a2", attempt=1, ending="FAILED", **failed)
    return sweep, [c.run_id for c in claims]


class Served:
    def __init__(self, proc: subprocess.Popen[str], url: str, lines: queue.Queue[str]) -> None:
        self.proc, self.url, self.lines = proc, url, lines

    def get(self, path: str) -> tuple[int, str, str]:
        try:
            with urllib.request.urlopen(self.url.rstrip("/") + path, timeout=10) as r:
                return r.status, r.headers["Content-Type"], r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers["Content-Type"], exc.read().decode()


@contextlib.contextmanager
def _serve(url: str, sweep: str, *extra: str) -> Iterator[Served]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "preemptible", "status", sweep, "--db", url, "--serve", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + 30
        seen = []
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no address line within 30 s: {seen}"
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            seen.append(line)
            match = re.search(r"at (http://\S+/)", line)
            if match:
                break
        yield Served(proc, match.group(1), lines)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[Store, str]]:
    url = f"sqlite:///{tmp_path / 'sweeps.db'}"
    s = open_store(url, retry_timeout=10)
    yield s, url
    s.close()


def test_page_and_api_escaped_404_and_sigterm(store: tuple[Store, str]) -> None:
    s, url = store
    sweep, ids = _sweep(s)
    with _serve(url, sweep, "--port", "0") as served:
        status, kind, page = served.get("/")
        assert status == 200 and kind.startswith("text/html")
        assert EVIL not in page and EVIL_PARAM not in page
        assert html_escaped(EVIL) in page
        assert "&quot;&gt;&lt;svg onload=alert(1)&gt;" in page
        for run_id in ids:
            assert f'data-run="{run_id}"' in page
        assert 'class="state s-FINISHED"' in page and ">RUNNING<" in page
        assert not re.search(r"(src|href)=\"?(https?:)?//", page)  # nothing from elsewhere

        status, kind, body = served.get("/api/sweep")
        assert status == 200 and kind == "application/json"
        doc = json.loads(body)
        assert doc["sweep"]["id"] == sweep and doc["sweep"]["name"] == EVIL
        assert doc["counts"]["FINISHED"] == doc["counts"]["RUNNING"] == 1
        assert doc["counts"]["FAILED"] == doc["counts"]["PENDING"] == 1
        runs = {r["run_id"]: r for r in doc["runs"]}
        assert runs[ids[0]]["state"] == "FINISHED" and runs[ids[0]]["metric"] == 0.25
        assert runs[ids[0]]["checkpoint_step"] == 50 and runs[ids[0]]["attempt"] == 1
        assert runs[ids[1]]["params"] == {"lr": 0.02, "tag": EVIL_PARAM}
        assert runs[ids[1]]["age"] is not None and runs[ids[1]]["age"] >= 0
        assert [r["state"] for r in doc["runs"]] == ["FINISHED", "RUNNING", "FAILED", "PENDING"]

        for path in ("/etc/passwd", "/../sweeps.db", "/api", "/api/sweep/x", "/index.html"):
            assert served.get(path)[0] == 404, path

        # another Host header (DNS rebinding) is refused
        host, port = served.url.split("//")[1].rstrip("/").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/api/sweep", headers={"Host": f"evil.example:{port}"})
        assert conn.getresponse().status == 403
        conn.close()

        started = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=10) == 0
        assert time.monotonic() - started < 5


def html_escaped(text: str) -> str:
    return html.escape(text, quote=True)


def test_sigint_stops_it_and_a_busy_port_is_one_line(store: tuple[Store, str]) -> None:
    s, url = store
    sweep, _ = _sweep(s)
    with _serve(url, sweep, "--port", "0") as served:
        port = served.url.rstrip("/").rsplit(":", 1)[1]
        busy = subprocess.run(
            [
                sys.executable,
                "-m",
                "preemptible",
                "status",
                sweep,
                "--db",
                url,
                "--serve",
                "--port",
                port,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(SRC)},
        )
        assert busy.returncode == 2
        assert f"cannot serve on 127.0.0.1:{port}" in busy.stderr and "--port" in busy.stderr
        served.proc.send_signal(signal.SIGINT)
        assert served.proc.wait(timeout=10) == 0


def test_unknown_sweep_is_one_line(store: tuple[Store, str]) -> None:
    _, url = store
    done = subprocess.run(
        [sys.executable, "-m", "preemptible", "status", "nope", "--db", url, "--serve"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert done.returncode == 2 and "no sweep 'nope'" in done.stderr


BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def test_the_page_updates_in_a_browser(store: tuple[Store, str], tmp_path: Path) -> None:
    if not shutil.which(CHROMIUM):
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install -y chromium)")
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    s, url = store
    sweep, ids = _sweep(s)
    with _serve(url, sweep, "--port", "0") as served:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
            try:
                page = browser.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                dialogs: list[str] = []
                page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
                page.goto(served.url)
                state = page.locator(f'tr[data-run="{ids[1]}"] td.state')
                assert state.text_content() == "RUNNING"
                # the run finishes: the table shows it within a few refreshes
                done = {"exit_code": 0, "duration": 2.0, "checkpoint_step": 70, "summary": None}
                s.finish(ids[1], agent="a1", attempt=1, ending="FINISHED", **done)
                page.wait_for_function(
                    'id => document.querySelector(`tr[data-run="${id}"]`).dataset.state'
                    " === 'FINISHED'",
                    arg=ids[1],
                    timeout=15_000,
                )
                assert state.text_content() == "FINISHED"
                row = page.locator(f'tr[data-run="{ids[1]}"]')
                assert EVIL_PARAM in (row.locator("td.params").text_content() or "")
                assert page.locator("#status").text_content().startswith("updated")
                assert "2 FINISHED" in (page.locator("#counts").text_content() or "")
                page.screenshot(path=str(tmp_path / "status.png"), full_page=True)
                assert (tmp_path / "status.png").stat().st_size > 1000
                assert errors == [] and dialogs == []  # no script error, no injected alert
            finally:
                browser.close()
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=10) == 0
