"""``preemptible status SWEEP --serve``: the real CLI as a child process, serving a real SQLite
sweep queue whose runs went through the Store API; read with urllib (and, where chromium is
installed, in the session's headless browser: tests/support/browser.py); stopped with real
signals."""

from __future__ import annotations

import contextlib
import html
import http.client
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from preemptible.sweeps.store._queue import Store, open_store
from tests.support.browser import Tab

pytestmark = pytest.mark.timeout(120)

SRC = Path(__file__).resolve().parents[2] / "src"
EVIL = "<script>alert('x')</script>"
EVIL_PARAM = '"><svg onload=alert(1)>'  # within the cell's 24 characters
METRIC = "<img src=x onerror=alert(2)>"  # the metric's name, as the spec gives it
SPEC: dict[str, Any] = {
    "method": "random",
    "metric": {"name": METRIC, "goal": "minimize"},
    "parameters": {"lr": {"min": 0.001, "max": 0.1}},
}


def _sweep(store: Store) -> tuple[str, list[str]]:
    """Four runs: 0 FINISHED (loss 0.25), 1 RUNNING, 2 FAILED, 3 PENDING; hostile names."""
    sweep = store.create_sweep(SPEC, name=EVIL, run_cap=None, max_failures=0, max_preemptions=2)
    store.add_runs(sweep, [{"lr": 0.01}, {"lr": 0.02, "tag": EVIL_PARAM}, {"lr": 0.5}, {"lr": 0.1}])
    claims = []
    for i in range(3):
        c = store.claim(sweep, agent=f"a{i}", host="h", lease=600, propose=None)
        assert c is not None and c.index == i
        claims.append(c)
    done = {"exit_code": 0, "duration": 1.0, "checkpoint_step": 50, "summary": {METRIC: 0.25}}
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
def _serve(url: str, sweep: str, *extra: str, argv: list[str] | None = None) -> Iterator[Served]:
    """The CLI serving ``sweep`` (or ``argv``, a process that prints the same address line)."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    if argv is None:
        argv = [sys.executable, "-m", "preemptible", "status", sweep, "--db", url, "--serve"]
    proc = subprocess.Popen(
        [*argv, *extra],
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
        assert html_escaped(EVIL) in page and METRIC not in page
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
        # a run id never leaves its directory, and names a run of this sweep only
        for path in ("/run/..%2F..%2Fetc", "/run/a/b", "/api/run/..", f"/run/{ids[0]}/", "/run/"):
            assert served.get(path)[0] == 404, path
        assert served.get("/api/sweep?state=LOST")[0] == 400
        status, _, body = served.get("/?page=0")
        assert status == 400 and "page='0' is not valid" in body

        # filtered and paged: the same query for the page, its data and its timeline
        status, _, body = served.get("/api/sweep?state=FINISHED&state=failed")
        doc = json.loads(body)
        assert [r["run_id"] for r in doc["runs"]] == [ids[0], ids[2]]
        assert doc["filter"] == ["FINISHED", "FAILED"] and doc["page"]["matching"] == 2
        assert doc["best"] == {"run_id": ids[0], "metric": 0.25}
        status, _, page = served.get("/?state=RUNNING")
        assert (
            status == 200 and f'data-run="{ids[1]}"' in page and f'data-run="{ids[0]}"' not in page
        )
        assert 'value="RUNNING" checked' in page
        status, kind, svg = served.get("/best.svg")
        assert (
            status == 200
            and kind == "image/svg+xml"
            and 'class="marker marker-best" data-step="0"' in svg
        )
        assert METRIC not in svg and html_escaped(METRIC) in svg

        # a run's page and its data
        status, kind, page = served.get(f"/run/{ids[1]}")
        assert status == 200 and kind.startswith("text/html")
        assert EVIL_PARAM not in page and html_escaped(EVIL_PARAM) in page
        status, _, body = served.get(f"/api/run/{ids[0]}")
        run = json.loads(body)
        assert run["state"] == "FINISHED" and run["checkpoint_step"] == 50
        assert [a["ending"] for a in run["attempt_log"]] == ["FINISHED"]

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


SERVE_SHORT = """
import sys
from preemptible.sweeps.web._server import serve_status
serve_status(sys.argv[1], sys.argv[2], port=0, max_connections=8, idle_timeout=2.0)
"""


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]


def test_half_sent_requests_are_bounded_and_time_out(store: tuple[Store, str]) -> None:
    """60 connections that never finish their request: at most 8 are served at once (a
    thread each), the others are answered 503 at once, as is a normal request while all 8 are
    held; each held one is closed after the idle timeout (2 s here), also the one that trickles
    a byte every 0.2 s; then a normal request is served. Before, each kept a thread for good."""
    s, url = store
    sweep, _ = _sweep(s)
    argv = [sys.executable, "-c", SERVE_SHORT, url, sweep]
    with _serve(url, sweep, argv=argv) as served:
        pid = served.proc.pid
        address = urllib.parse.urlsplit(served.url)
        host, port = address.hostname, address.port
        assert host is not None and port is not None
        baseline = _threads(pid)
        partial = f"GET / HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n".encode()  # no blank line
        socks: list[socket.socket] = []
        opened: list[float] = []
        try:
            for _ in range(60):
                sock = socket.create_connection((host, port), timeout=10)
                opened.append(time.monotonic())
                sock.sendall(partial)
                sock.setblocking(False)
                socks.append(sock)
            answers: dict[int, bytes] = {}
            lasted: dict[int, float] = {}  # seconds from connecting to its end
            asked = False
            deadline = time.monotonic() + 30
            while len(lasted) < len(socks) and time.monotonic() < deadline:
                assert _threads(pid) <= baseline + 8, f"{_threads(pid)} threads"
                for i, sock in enumerate(socks):
                    if i in lasted:
                        continue
                    try:
                        data = sock.recv(4096)
                    except BlockingIOError:
                        if i == 0:  # the first, served: it trickles a header that never ends
                            with contextlib.suppress(OSError):
                                sock.send(b"X")
                        continue
                    if data:
                        answers[i] = answers.get(i, b"") + data
                    else:
                        lasted[i] = time.monotonic() - opened[i]
                if answers and not asked:  # all slots held: still an answer, at once
                    asked = True
                    status, _, body = served.get("/api/sweep")
                    assert status == 503 and "too many open connections" in body, body
                time.sleep(0.2)  # the trickler's pace; the loop's deadline bounds it
            assert len(lasted) == 60, f"{60 - len(lasted)} connections still open"
            refused = [i for i, a in answers.items() if a.startswith(b"HTTP/1.0 503 ")]
            held = [i for i in range(60) if i not in answers]
            assert refused and len(refused) + len(held) == 60 and 0 in held, (refused, held)
            assert all(1.5 <= lasted[i] < 15 for i in held), lasted  # closed after the 2 s
            status, _, _ = served.get("/api/sweep")
            assert status == 200
        finally:
            for sock in socks:
                sock.close()


def _row(run_id: str) -> str:
    return f'document.querySelector(`tr[data-run="{run_id}"]`)'


def test_the_page_follows_a_preemption_and_filters_in_a_browser(
    store: tuple[Store, str], tmp_path: Path, browser: Any
) -> None:
    s, url = store
    sweep, ids = _sweep(s)
    s.add_runs(sweep, [{"lr": 0.001 * i} for i in range(8)])
    for i in range(8):  # a history: run 3 and 7 more finish, getting better; one is left
        c = s.claim(sweep, agent=f"b{i}", host="node2", lease=600, propose=None)
        assert c is not None
        end = {"exit_code": 0, "duration": 1.0, "checkpoint_step": 50}
        summary = {METRIC: 0.9 - 0.1 * (i % 5)}
        s.finish(c.run_id, agent=f"b{i}", attempt=1, ending="FINISHED", summary=summary, **end)
    with _serve(url, sweep, "--port", "0") as served:
        tab = Tab(browser)
        page = tab.page
        page.goto(served.url)
        assert page.locator(f'tr[data-run="{ids[1]}"] td.state').text_content() == "RUNNING"
        assert EVIL in (page.locator("#header").text_content() or "")
        assert METRIC in (page.locator("#best").text_content() or "")

        # the run reports steps 0..40 of two metrics (the agent copies them as it would) ...
        first = s.run(ids[1]).epoch
        s.add_history(ids[1], _points(range(41)), attempt=1, epoch=first)
        # ... and is preempted with its checkpoint at 30: back in the queue, its preemption
        # counted
        stop = {"exit_code": 143, "duration": 2.0, "checkpoint_step": 30, "summary": None}
        assert s.finish(ids[1], agent="a1", attempt=1, ending="PREEMPTED", **stop) == "PENDING"
        tab.wait(f"{_row(ids[1])}.dataset.state === 'PENDING'")
        attempt = page.locator(f'tr[data-run="{ids[1]}"] td.attempt')
        assert attempt.text_content() == "1 (1p)"
        # ... and resumed by another agent: its second attempt runs
        again = s.claim(sweep, agent="a9", host="h9", lease=600, propose=None)
        assert again is not None and (again.run_id, again.attempt) == (ids[1], 2)
        tab.wait(f"{_row(ids[1])}.dataset.state === 'RUNNING'")
        assert attempt.text_content() == "2 (1p)"
        assert "a9@h9" in (page.locator(f'tr[data-run="{ids[1]}"]').text_content() or "")
        params = page.locator(f'tr[data-run="{ids[1]}"] td.params').text_content() or ""
        assert EVIL_PARAM in params  # shown as text: no element was made of it
        # the new attempt drops what followed the checkpoint and reports from step 31 on
        s.trim_history(ids[1], 30, epoch=again.epoch)
        s.add_history(ids[1], _points(range(31, 46)), attempt=2, epoch=again.epoch)
        _curves_follow_the_resume(served, s, browser, ids[1], again.epoch, tmp_path)

        # a better run finishes: the best line and the chart follow
        done = {"exit_code": 0, "duration": 1.0, "checkpoint_step": 60, "summary": {METRIC: 0.01}}
        s.finish(ids[1], agent="a9", attempt=2, ending="FINISHED", **done)
        tab.wait(
            "document.querySelector('#best-chart .marker-best')?.dataset.step === arg",
            "1",
        )
        assert ids[1] in (page.locator("#best a").text_content() or "")
        tab.shoot(tmp_path, "status-page.png")

        # filters: the URL says which, a reload keeps them, and the table shows only them
        page.locator("#filters label.c-FAILED").click()
        page.locator("#filters label.c-PENDING").click()
        tab.wait("location.search === '?state=PENDING&state=FAILED'")
        tab.wait(
            "[...document.querySelectorAll('#runs tr')].map(r => r.dataset.state).join() === "
            "'FAILED,PENDING'"
        )
        assert "of 2 PENDING or FAILED" in (page.locator("#pageinfo").text_content() or "")
        page.reload()
        assert page.locator("input[value=FAILED]").is_checked()
        assert page.locator("#runs tr").count() == 2
        page.go_back()  # the page before the second filter: FAILED alone
        tab.wait("location.search === '?state=FAILED'")
        tab.wait("document.querySelectorAll('#runs tr').length === 1")
        assert not page.locator("input[value=PENDING]").is_checked()
        page.locator(f'tr[data-run="{ids[2]}"] td.run a').click()  # to the run's page
        page.wait_for_url(f"**/run/{ids[2]}")
        assert page.locator("#attempts tr.ending-FAILED").count() == 1
        tab.close()
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=10) == 0


SECOND = "\"&'<b>"  # another metric, hostile too


def _points(steps: range) -> list[tuple[int, str, float]]:
    return [(st, name, v) for st in steps for name, v in ((METRIC, 1 / (st + 1)), (SECOND, st))]


def _marker(kind: str) -> str:
    return f"document.querySelector('#curves figure g[data-marker=\"{kind}\"]')?.dataset.step"


def _curves_follow_the_resume(
    served: Served, store: Store, browser: Any, run_id: str, epoch: int, tmp_path: Path
) -> None:
    """The run's page: a chart per metric (the sweep's first), a line per attempt, the
    preemption and the resume marked at the checkpoint's step; it follows new reports."""
    tab = Tab(browser)
    page = tab.page
    page.goto(f"{served.url}run/{run_id}")
    tab.wait(f"{_marker('preempted')} === '30' && {_marker('resumed')} === '30'")
    figures = page.locator("#curves figure.curve")
    assert figures.count() == 2
    assert [figures.nth(i).get_attribute("data-metric") for i in range(2)] == [METRIC, SECOND]
    lines = page.locator("#curves figure.curve").first.locator("polyline")
    assert [lines.nth(i).get_attribute("data-attempt") for i in range(lines.count())] == ["1", "2"]
    texts = page.locator("#curves figure.curve").first.locator("text.marker-text")
    assert texts.all_text_contents() == ["preempted at 30", "attempt 2 from 30"]
    assert "46 reports" in (figures.first.locator("title").first.text_content() or "")
    status, _, body = served.get(f"/api/run/{run_id}")
    curves = json.loads(body)["curves"]
    assert status == 200 and curves["metrics"] == 2 and list(curves["drawn"]) == [METRIC, SECOND]
    points = curves["drawn"][METRIC]["points"]
    assert [p[0] for p in points] == list(range(46))  # 31..40 of attempt 1 were trimmed
    assert {p[2] for p in points if p[0] <= 30} == {1} and {p[2] for p in points[31:]} == {2}

    # the attempt reports on: the page redraws the chart
    store.add_history(run_id, _points(range(46, 61)), attempt=2, epoch=epoch)
    tab.wait(
        "document.querySelector('#curves figure.curve title')?.textContent.includes(arg)",
        "61 reports",
    )
    tab.shoot(tmp_path, "status-run-curves.png")
    tab.close()


def test_on_postgresql_the_page_never_shows_the_password(pg_server: Any) -> None:
    secret = "Sup3r-s3cret"
    with pg_server.database() as name:
        parts = urllib.parse.urlsplit(pg_server.database_url(name))
        user = parts.username or "postgres"
        netloc = f"{user}:{secret}@{parts.hostname}:{parts.port}"
        url = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
        s = open_store(url, retry_timeout=30)
        try:
            sweep, ids = _sweep(s)
            with _serve(url, sweep, "--port", "0") as served:
                doc = json.loads(served.get("/api/sweep?state=FINISHED")[2])
                assert [r["run_id"] for r in doc["runs"]] == [ids[0]]
                assert doc["best"] == {"run_id": ids[0], "metric": 0.25}
                assert doc["database"].startswith("postgresql://") and secret not in doc["database"]
                for path in ("/", "/api/sweep", f"/run/{ids[1]}", f"/api/run/{ids[0]}"):
                    status, _, body = served.get(path)
                    assert status == 200 and secret not in body, path
                served.proc.send_signal(signal.SIGTERM)
                assert served.proc.wait(timeout=10) == 0
                assert secret not in "".join(list(served.lines.queue))
        finally:
            s.close()
