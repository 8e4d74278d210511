"""A fault injector in front of a real server: an HTTP proxy on 127.0.0.1 that answers the first
N requests itself (503 SlowDown, as S3 throttles), stalls when told to (accepts, reads, never
answers), cuts when told to (closes each connection unanswered), and otherwise forwards
every request to the server as it came, recording the method and path of each. The client
under test is not touched: it talks HTTP to the proxy exactly as it would to the server
(``AWS_ENDPOINT_URL`` points at the proxy).

Run as a program (``python tests/support/faults.py TARGET``) it is a server process of its
own, which a test kills (SIGKILL) in the middle of an upload: the server the client talks to
dies, and the objects already stored behind it can still be read back from the real server.
It prints ``listening PORT``, then ``METHOD PATH`` as each request starts.
"""

from __future__ import annotations

import contextlib
import http.client
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultProxy:
    """``endpoint`` is the proxy's URL; ``requests`` what reached it, as ``"METHOD /path"``
    (a POST's body follows: a bulk delete lists its keys there)."""

    def __init__(self, target: str, *, announce: bool = False) -> None:
        self.target = urlsplit(target)
        self.announce = announce
        self.refuse = 0  # answer this many of the next requests with 503 SlowDown
        self.refused = 0
        self.stall = threading.Event()  # set: requests are read and not answered; cleared:
        # the requests held drop their connections (the client retries), new ones pass
        self.requests: list[str] = []
        # a request starting "METHOD /path-prefix": once one is answered, ``stall`` is set (the
        # requests that follow it hang: a fault at an exact point of a protocol)
        self.stall_after: str | None = None
        self.cut = threading.Event()  # set: every request's connection is closed unanswered
        # set: deletes (DELETE, a bulk POST ?delete) wait until it is cleared, then go on (a
        # bucket that answers deletes slowly, as a throttled one does)
        self.hold_deletes = threading.Event()
        self._release = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                proxy.requests.append(f"{self.command} {self.path}")
                if proxy.announce:
                    sys.stdout.write(f"{self.command} {self.path}\n")
                    sys.stdout.flush()
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.command == "POST":  # a bulk delete names its keys in the body
                    proxy.requests[-1] += " " + body[:4000].decode("utf-8", "replace")
                deleting = self.command == "DELETE" or (
                    self.command == "POST" and "delete" in self.path
                )
                while deleting and proxy.hold_deletes.is_set() and not proxy._release.wait(0.02):
                    pass
                if proxy.cut.is_set():  # as a server that died: no answer, the connection gone
                    self.close_connection = True
                    return
                if proxy.stall.is_set():  # until the stall ends: then the connection drops
                    while proxy.stall.is_set() and not proxy._release.wait(0.02):
                        pass
                    self.close_connection = True
                    return
                if proxy.refuse > 0:
                    proxy.refuse -= 1
                    proxy.refused += 1
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                conn = http.client.HTTPConnection(
                    proxy.target.hostname, proxy.target.port, timeout=60
                )
                try:
                    conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                    answer = conn.getresponse()
                    data = answer.read()
                finally:
                    conn.close()
                self.send_response(answer.status, answer.reason)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                self.wfile.flush()
                after = proxy.stall_after
                if after is not None and f"{self.command} {self.path}".startswith(after):
                    proxy.stall.set()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def fault_proxy(target: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(target)
    try:
        yield proxy
    finally:
        proxy.close()


if __name__ == "__main__":
    served = FaultProxy(sys.argv[1], announce=True)
    sys.stdout.write(f"listening {served.server.server_address[1]}\n")
    sys.stdout.flush()
    threading.Event().wait()
