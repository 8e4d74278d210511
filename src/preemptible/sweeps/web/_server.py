"""``preemptible status SWEEP --serve``: the sweep as a live web page.

A small HTTP server of the standard library (one thread per request), bound to 127.0.0.1
unless ``--host`` says otherwise, with fixed routes and nothing else (any other path is a 404,
so no file is ever served from disk):

* ``/``: the sweep's page (``_page``): the header, the counts as state filters, a page of
  the runs table, the best run and the best-so-far chart; ``?state=A&state=B&page=N`` filters
  and pages it, so a filtered page can be linked. No external asset (the machine may have no
  network): inline CSS and SVG drawn here, and a script that redraws it every 2 s;
* ``/api/sweep`` (same query): that page's data as JSON; ``/best.svg``: the chart alone;
  ``/timeline.svg`` (same query): the attempts timeline of that page's runs, as the page
  shows it; ``/plot.png`` (same query): the same as ``status --plot`` draws it
  (``_status.timeline_figure``; 404 without matplotlib);
* ``/run/ID`` and ``/api/run/ID``: a run's page and its data (``_run_page``): attempts, metric
  curves with preemptions and resumes marked, its journal and records from ``--home``.

A sweep of 100,000 runs is read whole once, then only the runs that changed
(``_model``): no page sends or draws more than a table page of rows or a chart's points.
Everything shown comes from the queue or a run's files, which any agent, run or spec writes:
the server escapes it (``_html``), and the scripts only set text or put in place markup
the server drew.

The database is read with one connection (``open_store(reader=True)``), one request at a time.
Its address is shown as ``Store.display``: never its password. A database that fails is a 503
with the reason; the page then keeps the last table under a line saying since when. A query
the page does not take is a 400 naming it; an unknown run, a 404.

Served on a loopback address, a request must name the server by a loopback name in its
``Host`` header: a web page elsewhere cannot read the sweep through a DNS name of its own
that it points at 127.0.0.1 (DNS rebinding).

A connection costs a thread, so they are bounded: at most ``MAX_CONNECTIONS`` are served at
once, and one more is answered 503 (``Retry-After: 1``) at once by the serving thread and closed
(the page's script retries anyway). A client has ``IDLE_TIMEOUT`` seconds to send its whole
request, however slowly it trickles in, and each write to it must go through within as long;
then its connection is closed. Without both, 800 half-sent requests kept 801 threads.

Ctrl+C, SIGTERM or SIGHUP stops the server: the handler only records that a stop came; the
main thread, which serves, sees it within ``_POLL`` seconds, closes the server and the
database, and the command exits 0.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import ipaddress
import logging
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from ..._env import env_float
from ..._errors import ConfigError, PreemptibleError
from ..._text import printable
from ...stop._signals import install_handlers, restore_handlers, signal_name
from ..status._snapshot import _encode
from ..status._timeline import timeline_figure
from ..store._connector import DEFAULT_RETRY_TIMEOUT
from ..store._queue import Store, open_store
from ._html import parse_query, policy
from ._model import PAGE_ROWS, SweepModel
from ._page import best_chart, render_page, sweep_document
from ._run_page import render_live, render_run_page, run_document
from ._timeline_svg import timeline_svg

logger = logging.getLogger("preemptible")

DEFAULT_PORT = 8765
MAX_CONNECTIONS = 32  # a few tabs of a browser (six connections each) with room to spare
IDLE_TIMEOUT = 15.0  # seconds to send a request (a browser sends it at once), or to take a write
_POLL = 0.25  # how often the serving thread looks whether a stop came
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_HTML = "text/html; charset=utf-8"
T = TypeVar("T")


# -- the server -------------------------------------------------------------------------------
class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck browser never holds the command open at exit
    # connections waiting to be accepted (or refused): socketserver's 5 dropped the others'
    # first packet in a burst, and each such client waited a second or more to try again
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        store: Store,
        model: SweepModel,
        home: Path,
        *,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout: float = IDLE_TIMEOUT,
    ) -> None:
        self.idle_timeout = idle_timeout
        self.slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections
        self._told_full = False
        self.store = store
        self.sweep_id = model.sweep_id
        self.home = home
        self.model = model
        self.lock = threading.Lock()  # one Store is one connection: one request at a time
        self.plot = importlib.util.find_spec("matplotlib") is not None
        super().__init__(address, _Handler)
        self.allowed_hosts: set[str] | None = None
        if _is_loopback(address[0]):
            port = self.server_address[1]
            names = {"localhost", "127.0.0.1", "[::1]", address[0], f"[{address[0]}]"}
            self.allowed_hosts = {f"{n}:{port}" for n in names} | names

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread for the connection while a slot is free; else a 503 from here, at once."""
        if not self.slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: it will not give the slot back
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def _refuse(self, request: socket.socket) -> None:
        if not self._told_full:
            self._told_full = True
            logger.warning(
                "preemptible: web: %d connections are open, the most served at once; more "
                "are answered 503 until some close",
                self.max_connections,
            )
        body = b"too many open connections; try again in a moment\n"
        head = (
            "HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        with contextlib.suppress(OSError):
            request.setblocking(False)  # the serving thread never waits on a client
            # read what the client sent so far: closing with it unread would reset the
            # connection, and the client could lose the answer
            request.recv(65536)
        with contextlib.suppress(OSError):
            request.send(head.encode() + body)  # a new socket's buffer takes it whole
        self.shutdown_request(request)

    def locked(self, fn: Callable[[], T]) -> T:
        with self.lock:
            return fn()

    def sweep(self, states: frozenset[str], page: int) -> dict[str, Any]:
        return self.locked(lambda: sweep_document(self.model, self.store, states=states, page=page))

    def page(self, states: frozenset[str], page: int) -> tuple[dict[str, Any], str]:
        """The sweep's page: its document and its chart, read together."""

        def read() -> tuple[dict[str, Any], str]:
            doc = sweep_document(self.model, self.store, states=states, page=page)
            return doc, best_chart(self.model)

        return self.locked(read)

    def run(self, run_id: str) -> dict[str, Any] | None:
        def read() -> dict[str, Any] | None:
            if not self.model.head:
                self.model.refresh(self.store)
            metric = self.model.head.get("metric")
            return run_document(
                self.store,
                sweep_id=self.sweep_id,
                run_id=run_id,
                home=self.home,
                metric=metric["name"] if metric else None,
            )

        return self.locked(read)

    def chart(self) -> str:
        def read() -> str:
            self.model.refresh(self.store)
            return best_chart(self.model)

        return self.locked(read)

    def png(self, states: frozenset[str], page: int) -> bytes:
        """The timeline of the runs on that page of the table, drawn by matplotlib."""

        def read() -> dict[str, Any]:
            self.model.refresh(self.store)
            ids = self.model.matching(states)
            first = (max(1, min(page, -(-len(ids) // PAGE_ROWS))) - 1) * PAGE_ROWS
            runs = self.model.page_docs(self.store, ids[first : first + PAGE_ROWS], time.time())
            return {"sweep": self.model.head, "runs": runs}

        figure = timeline_figure(self.locked(read))  # drawn outside the lock
        out = io.BytesIO()
        figure.savefig(out, format="png")
        return out.getvalue()


class _Refused(PreemptibleError):
    """A request this server does not answer: a 400 (a query it does not take) or a 404 (no
    such run), with this line."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def _query(query: str) -> tuple[frozenset[str], int]:
    try:
        return parse_query(query)
    except ConfigError as exc:
        raise _Refused(HTTPStatus.BAD_REQUEST, str(exc)) from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _DeadlineReader(io.RawIOBase):
    """The connection's reading side, with one deadline for all of the request: a client that
    trickles a byte now and then is cut off as one that sends nothing."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        super().__init__()
        self.sock = sock
        self.deadline = time.monotonic() + timeout

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request took too long to arrive")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "preemptible"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # left open, the socket's file would keep the connection open
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self.server.idle_timeout))

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        # the request is in: each write may take as long (a client that stops reading is let go)
        self.connection.settimeout(self.server.idle_timeout)
        host = self.headers.get("Host", "").lower()
        if self.server.allowed_hosts is not None and host not in self.server.allowed_hosts:
            self._send(HTTPStatus.FORBIDDEN, "text/plain", b"unknown Host header\n")
            return
        parts = urlsplit(self.path)
        route, query = parts.path, parts.query
        try:
            try:
                self._route(route, query)
            except _Refused as exc:
                status = exc.status
                raise
            except PreemptibleError:
                status = HTTPStatus.SERVICE_UNAVAILABLE  # the database failed
                raise
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the browser went away, or stopped reading
        except PreemptibleError as exc:
            if route.startswith("/api/"):
                self._send(status, "application/json", _encode({"error": str(exc)}).encode())
            else:
                self._send(status, "text/plain; charset=utf-8", f"{exc}\n".encode())

    def _route(self, route: str, query: str) -> None:
        server = self.server
        if route in ("/", "/api/sweep", "/timeline.svg", "/plot.png"):
            states, page = _query(query)
            if route == "/":
                self._page(states, page)
            elif route == "/api/sweep":
                doc = server.sweep(states, page)
                self._send(HTTPStatus.OK, "application/json", _encode(doc).encode())
            elif route == "/timeline.svg":
                svg = timeline_svg(server.sweep(states, page))
                self._send(HTTPStatus.OK, "image/svg+xml", svg.encode())
            elif server.plot:
                self._send(HTTPStatus.OK, "image/png", server.png(states, page))
            else:
                raise _Refused(HTTPStatus.NOT_FOUND, "no /plot.png without matplotlib")
        elif route == "/best.svg":
            self._send(HTTPStatus.OK, "image/svg+xml", server.chart().encode())
        elif route.startswith(("/run/", "/api/run/")):
            api = route.startswith("/api/")
            if query not in ("", "part=live") or (api and query):
                raise _Refused(HTTPStatus.BAD_REQUEST, "a run's page takes no query")
            run_id = unquote(route.split("/run/", 1)[1])
            run = server.run(run_id)
            if run is None:
                shown = printable(run_id)[:130]
                raise _Refused(HTTPStatus.NOT_FOUND, f"no run {shown!r} in sweep {server.sweep_id}")
            if api:
                self._send(HTTPStatus.OK, "application/json", _encode(run).encode())
            elif query:  # what its script redraws: markup only, no style or script
                self._send(HTTPStatus.OK, _HTML, render_live(run).encode())
            else:
                nonce = secrets.token_urlsafe(16)
                html = render_run_page(run, nonce=nonce)
                self._send(HTTPStatus.OK, _HTML, html.encode(), policy=policy(nonce))
        elif route == "/favicon.ico":  # asked for by every browser: none, and no error
            self._send(HTTPStatus.NO_CONTENT, "image/x-icon", b"")
        else:
            self._send(HTTPStatus.NOT_FOUND, "text/plain", b"not found\n")

    def _page(self, states: frozenset[str], page: int) -> None:
        nonce = secrets.token_urlsafe(16)
        doc, chart, error = None, "", None
        try:
            doc, chart = self.server.page(states, page)
        except PreemptibleError as exc:
            error = f"database unreachable: {exc}"
        html = render_page(doc, error, nonce=nonce, chart=chart, states=states)
        status = HTTPStatus.OK if error is None else HTTPStatus.SERVICE_UNAVAILABLE
        self._send(status, _HTML, html.encode(), policy=policy(nonce))

    def _send(self, status: HTTPStatus, kind: str, body: bytes, *, policy: str = "") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", policy or "default-src 'none'")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("preemptible: web: " + format, *args)


def _bind_error(host: str, port: int, exc: OSError) -> ConfigError:
    return ConfigError(
        f"cannot serve on {host}:{port}: {exc.strerror or exc}; choose another with "
        "--port N (0: any free port) or --host"
    )


def check_port(host: str, port: int) -> None:
    """ConfigError when ``port`` is not one to serve on, or cannot be bound now (taken)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: give a port between 1 and 65535, or 0 for a free one")
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise _bind_error(host, port, exc) from None


def _print(line: str) -> None:
    print(line, flush=True)


def page_address(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    if host in ("0.0.0.0", "::"):  # every address of this host: name one that works here
        shown = "127.0.0.1" if host == "0.0.0.0" else "[::1]"
    return f"http://{shown}:{port}/"


def serve_status(
    db: str | None,
    sweep_id: str,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    home: Path | None = None,
    echo: Callable[[str], None] | None = None,
    max_connections: int = MAX_CONNECTIONS,
    idle_timeout: float = IDLE_TIMEOUT,
) -> None:
    """Serve the sweep's page until Ctrl+C, SIGTERM or SIGHUP (then return: exit 0). The
    first line given to ``echo`` (default: printed) is ``serving sweep ID at
    http://HOST:PORT/`` (port 0: the free port the system picked). ``home``: the agents'
    ``--home``, where the run pages read each run's journal and records (default
    ``.preemptible``). ``max_connections`` and ``idle_timeout``: connections served at once,
    and seconds a client has to send its request (tests shorten it)."""
    say = _print if echo is None else echo
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: give a port between 1 and 65535, or 0 for a free one")
    configured = env_float("PREEMPTIBLE_DB_RETRY_TIMEOUT", DEFAULT_RETRY_TIMEOUT)
    retry = min(configured if configured is not None else DEFAULT_RETRY_TIMEOUT, 2.0)
    store = open_store(db, reader=True, retry_timeout=retry)
    server: _Server | None = None
    try:
        model = SweepModel(sweep_id)
        model.refresh(store)  # an unknown sweep is a ConfigError now, not a 503; and the
        # whole sweep is read once before the first page is asked for
        try:
            server = _Server(
                (host, port),
                store,
                model,
                Path(".preemptible") if home is None else home,
                max_connections=max_connections,
                idle_timeout=idle_timeout,
            )
        except OSError as exc:
            raise _bind_error(host, port, exc) from None
        stops: list[int] = []

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stops.append(signum)  # only noted: the serving loop below stops

        previous, _ = install_handlers(_SIGNALS, on_signal)
        try:
            server.timeout = _POLL
            address = page_address(host, server.server_address[1])
            say(f"serving sweep {printable(sweep_id)} at {address} (Ctrl+C stops)")
            while not stops:
                server.handle_request()
        finally:
            restore_handlers(previous, ours=on_signal)
            server.server_close()
        say(f"stopped ({signal_name(stops[0])})")
    finally:
        # a request still reading (in its thread) finishes first; a database that hangs
        # holds the exit for at most a few seconds
        held = server is None or server.lock.acquire(timeout=5.0)
        if held:
            store.close()
