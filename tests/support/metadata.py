"""Cloud metadata services served on 127.0.0.1, answering as their documentation says.

One server plays GCE, EC2 (IMDSv2) and Azure Scheduled Events at once; a test flips ``state``
and points the watcher at ``server.url`` through the platform's override variable. ``fault``
makes every answer of one platform misbehave: "500", "404", "slow" (sleeps past any client
timeout), "garbage", "redirect" (302 to ``redirect_to``; the EC2 token PUT still answers),
"drip-headers" or "drip-body" (one byte every ``drip_seconds``, for a long time).

The ``metadata_server`` fixture is one, started for a test and stopped after it.

Run it by hand with ``python -m tests.support.metadata`` (prints its URL, serves until killed).
"""

from __future__ import annotations

import email.utils
import json
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest


@dataclass
class State:
    gce_preempted: str = "FALSE"
    gce_maintenance: str = "NONE"
    ec2_action: dict[str, str] | None = None
    ec2_rebalance: dict[str, str] | None = None
    azure_events: list[dict[str, Any]] = field(default_factory=list)
    azure_acks: list[str] = field(default_factory=list)
    fault: dict[str, str] = field(default_factory=dict)  # platform -> fault
    tokens: dict[str, float] = field(default_factory=dict)  # token -> expiry (monotonic)
    requests: list[tuple[str, str]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)  # of each request, in order
    slow_seconds: float = 5.0
    redirect_to: str = ""
    drip_seconds: float = 0.2
    closed: threading.Event = field(default_factory=threading.Event)  # ends every drip

    def azure_event(self, event_type: str, not_before_in: float) -> str:
        event_id = secrets.token_hex(8)
        when = email.utils.formatdate(time.time() + not_before_in, usegmt=True)
        self.azure_events.append(
            {
                "EventId": event_id,
                "EventType": event_type,
                "ResourceType": "VirtualMachine",
                "Resources": ["vm-test"],
                "EventStatus": "Scheduled",
                "NotBefore": when,
                "Description": "",
                "EventSource": "Platform",
                "DurationInSeconds": -1,
            }
        )
        return event_id

    def ec2_interrupt(self, in_seconds: float, action: str = "terminate") -> None:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + in_seconds))
        self.ec2_action = {"action": action, "time": when}

    def expire_tokens(self) -> None:
        self.tokens.clear()


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: str = "", ctype: str = "text/plain") -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> None:
        self.server.state.requests.append((self.command, self.path))
        self.server.state.headers.append(dict(self.headers))

    def _drip(self, data: bytes) -> None:
        """Keeps the connection busy: each byte resets a per-read socket timeout."""
        for i in range(len(data)):
            if self.server.state.closed.wait(self.server.state.drip_seconds):
                return
            try:
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
            except OSError:  # the client gave up
                return

    def _fault(self, platform: str) -> bool:
        state = self.server.state
        fault = state.fault.get(platform)
        if fault is None:
            return False
        body = b"FALSE" * 200
        if fault == "slow":
            time.sleep(state.slow_seconds)
            self._send(200, "late")
        elif fault == "redirect":
            self.send_response(302)
            self.send_header("Location", state.redirect_to + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif fault == "drip-headers":
            self.close_connection = True
            self._drip(b"HTTP/1.1 200 OK\r\n" + b"X-Drip: 1\r\n" * 500 + b"\r\nFALSE")
        elif fault == "drip-body":
            self.close_connection = True
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            self.wfile.write(head)
            self.wfile.flush()
            self._drip(body)
        elif fault == "garbage":
            self._send(200, "\x00<html>not what you asked for", "text/html")
        else:
            self._send(int(fault), "fault")
        return True

    def do_GET(self) -> None:
        self._record()
        path = urlsplit(self.path).path
        if path.startswith("/computeMetadata/"):
            self._gce(path)
        elif path.startswith("/latest/"):
            self._ec2_get(path)
        elif path == "/metadata/scheduledevents":
            self._azure_get()
        else:
            self._send(404, "not found")

    def do_PUT(self) -> None:
        self._record()
        if self.path != "/latest/api/token":
            self._send(404)
            return
        if self.server.state.fault.get("ec2") != "redirect" and self._fault("ec2"):
            return
        ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            self._send(400, "missing or invalid X-aws-ec2-metadata-token-ttl-seconds")
            return
        token = secrets.token_urlsafe(24)
        self.server.state.tokens[token] = time.monotonic() + int(ttl)
        self._send(200, token)

    def do_POST(self) -> None:
        self._record()
        if urlsplit(self.path).path != "/metadata/scheduledevents":
            self._send(404)
            return
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        if self._fault("azure"):
            return
        for start in body.get("StartRequests", []):
            self.server.state.azure_acks.append(start["EventId"])
            self.server.state.azure_events = [
                e for e in self.server.state.azure_events if e["EventId"] != start["EventId"]
            ]
        self._send(200)

    # --- GCE: Metadata-Flavor header required; values as plain text
    def _gce(self, path: str) -> None:
        if self.headers.get("Metadata-Flavor") != "Google":
            self._send(403, "Missing Metadata-Flavor:Google header.")
            return
        if self._fault("gce"):
            return
        key = path.removeprefix("/computeMetadata/v1/instance/")
        if key == "preempted":
            self._send(200, self.server.state.gce_preempted)
        elif key == "maintenance-event":
            self._send(200, self.server.state.gce_maintenance)
        else:
            self._send(404)

    # --- EC2 IMDSv2: a valid, unexpired token on every GET; 404 when there is no notice
    def _ec2_get(self, path: str) -> None:
        token = self.headers.get("X-aws-ec2-metadata-token")
        expiry = self.server.state.tokens.get(token or "")
        if expiry is None or expiry < time.monotonic():
            self._send(401)
            return
        if self._fault("ec2"):
            return
        if path == "/latest/meta-data/spot/instance-action":
            action = self.server.state.ec2_action
            self._send(*(200, json.dumps(action)) if action else (404,))
        elif path == "/latest/meta-data/events/recommendations/rebalance":
            rebalance = self.server.state.ec2_rebalance
            self._send(*(200, json.dumps(rebalance)) if rebalance else (404,))
        else:
            self._send(404)

    # --- Azure Scheduled Events: header Metadata: true, api-version required
    def _azure_get(self) -> None:
        if self.headers.get("Metadata") != "true":
            self._send(
                400, json.dumps({"error": "Bad request. Required metadata header not specified"})
            )
            return
        if "api-version" not in parse_qs(urlsplit(self.path).query):
            self._send(400, json.dumps({"error": "Bad request. api-version was not specified"}))
            return
        if self._fault("azure"):
            return
        state = self.server.state
        doc = {
            "DocumentIncarnation": len(state.azure_acks) + len(state.azure_events),
            "Events": state.azure_events,
        }
        self._send(200, json.dumps(doc), "application/json")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: State

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up on a slow answer is expected here, not news


class MetadataServer:
    def __init__(self) -> None:
        self.state = State()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.state = self.state
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def __enter__(self) -> MetadataServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.state.closed.set()
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def metadata_server() -> Iterator[MetadataServer]:
    """A fresh server (GCE, EC2, Azure at once) for one test: ``.host``, ``.url``, ``.state``."""
    with MetadataServer() as server:
        yield server


if __name__ == "__main__":
    with MetadataServer() as server:
        print(server.url, flush=True)
        threading.Event().wait()
