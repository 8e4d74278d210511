"""A minimal HTTP client for metadata servers: no proxies, no redirects, a total deadline.

Why not urllib: it follows redirects (re-sending headers such as the IMDSv2 token to whatever
host the Location names), and its timeout bounds each socket operation, not the request, so
a server that drips a byte now and then holds the caller forever. Here one request is one
connection to the configured host, bounded as a whole: name lookup, connect, send, headers
and body all share one deadline.
"""

from __future__ import annotations

import base64
import http.client
import io
import ipaddress
import re
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import unquote, urlsplit

from .._errors import ConfigError, NoticeError

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

BODY_LIMIT = 1 << 20
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::([0-9]{1,5}))?")


@dataclass(frozen=True)
class Response:
    status: int
    body: str
    headers: dict[str, str]


@dataclass(frozen=True)
class Endpoint:
    """Where a metadata server is. ``base`` carries no credentials, so it is what every
    message shows; user:password from the URL travel only as HTTP Basic authentication to
    this very host."""

    base: str
    authorization: str | None = None

    def headers(self, extra: dict[str, str]) -> dict[str, str]:
        if self.authorization is None:
            return dict(extra)
        return {**extra, "Authorization": self.authorization}


def _redacted(value: str) -> str:
    """``value`` with everything between the scheme and the last "@" hidden."""
    scheme, sep, rest = value.partition("://")
    if not sep:
        scheme, rest = "", value
    if "@" not in rest:
        return value
    return f"{scheme}{sep}***@{rest.rsplit('@', 1)[1]}"


def parse_endpoint(value: str, name: str) -> Endpoint:
    """``host[:port]`` or an ``http(s)://[user:password@]host[:port][/path]`` URL.

    ``name`` (the variable or argument) is named in the error, with the value redacted.
    """
    shown = _redacted(value)
    if not value or any(c.isspace() for c in value):
        raise ConfigError(
            f"{name}={shown!r} is not valid; use host[:port] or an http(s):// URL, no spaces"
        )
    url = value if "://" in value else f"http://{value}"
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = urlsplit("http://")  # an unbalanced [IPv6 literal: reported as a bad host
    hostport = parts.netloc.rsplit("@", 1)[-1]
    match = _HOST_PORT.fullmatch(hostport)
    problem = ""
    if parts.scheme.lower() not in ("http", "https"):
        problem = f"scheme {parts.scheme!r} is not http or https"
    elif match is None:
        problem = "the host is empty or not a host name or address"
    elif match.group(2) is not None and not 0 < int(match.group(2)) < 65536:
        problem = "the port is not 1-65535"
    elif "://" not in value and parts.path not in ("", "/"):
        problem = "a path needs an http:// or https:// URL"
    elif parts.query or parts.fragment or url.endswith(("?", "#")):
        problem = "a query or fragment is not allowed"
    if problem:
        raise ConfigError(
            f"{name}={shown!r} is not valid ({problem}); use host[:port] or an http(s):// URL"
        )
    authorization = None
    userinfo = unquote(parts.netloc.rsplit("@", 1)[0]) if "@" in parts.netloc else ""
    if userinfo:
        user, _, password = userinfo.partition(":")
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        authorization = f"Basic {token}"
    base = f"{parts.scheme.lower()}://{hostport}{parts.path}".rstrip("/")
    return Endpoint(base, authorization)


class _Deadline:
    def __init__(self, seconds: float, what: str) -> None:
        self.seconds = seconds
        self.what = what
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise self.expired()
        return left

    def expired(self) -> TimeoutError:
        return TimeoutError(f"{self.what}: no complete answer within {self.seconds:g} s")


class _TimedReader(io.RawIOBase):
    """The socket's bytes, each read waiting at most the time left before the deadline."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        self._sock.settimeout(self._deadline.left())
        return self._sock.recv_into(buffer)


class _TimedSocket:
    """All of a socket that ``http.client.HTTPResponse`` uses: ``makefile``."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self._reader = _TimedReader(sock, deadline)

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(self._reader)


Addresses = list[tuple[Any, ...]]


def _addresses(host: str, port: int, deadline: _Deadline) -> Addresses:
    """getaddrinfo has no timeout; a name is looked up in a daemon thread we stop waiting for."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found: list[Addresses | OSError] = []

    def lookup() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            found.append(exc)

    thread = threading.Thread(target=lookup, name="preemptible-getaddrinfo", daemon=True)
    thread.start()
    thread.join(deadline.left())
    if not found:
        raise deadline.expired()
    if isinstance(found[0], OSError):
        raise found[0]
    return found[0]


def _connect(host: str, port: int, deadline: _Deadline) -> socket.socket:
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, address in _addresses(host, port, deadline):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(deadline.left())
            sock.connect(address)
        except OSError as exc:
            sock.close()
            if isinstance(exc, TimeoutError):
                raise
            error = exc
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise error


def _tls(sock: socket.socket, host: str, deadline: _Deadline) -> ssl.SSLSocket:
    """The handshake is many reads; done without blocking, it too ends by the deadline."""
    tls = ssl.create_default_context().wrap_socket(
        sock, server_hostname=host, do_handshake_on_connect=False
    )
    try:
        tls.setblocking(False)
        while True:
            try:
                tls.do_handshake()
                return tls
            except ssl.SSLWantReadError:
                select.select([tls], [], [], deadline.left())
            except ssl.SSLWantWriteError:
                select.select([], [tls], [], deadline.left())
    except BaseException:
        tls.close()  # it owns the connection now
        raise


def request(
    method: str,
    url: str,
    *,
    headers: dict[str, str] | None = None,
    data: bytes | None = None,
    timeout: float = 2.0,
) -> Response:
    """One request to ``url`` (credential-free: it appears in errors), done within ``timeout``
    seconds in all. HTTP error statuses are returned; a redirect raises ``NoticeError`` and its
    Location is never contacted; network errors and the deadline raise ``OSError``
    (``TimeoutError`` for the deadline)."""
    what = f"{method} {url}"
    deadline = _Deadline(timeout, what)
    parts = urlsplit(url)
    host = parts.hostname or ""
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    sock: socket.socket | None = None
    try:
        sock = _connect(host, port, deadline)
        if https:
            sock = _tls(sock, host, deadline)
        conn = http.client.HTTPConnection(host, port)
        conn.sock = sock
        sock.settimeout(deadline.left())  # sendall: the timeout bounds the whole call
        conn.request(method, target, body=data, headers={**(headers or {}), "Connection": "close"})
        # HTTPResponse only calls makefile() on what it is given
        resp = http.client.HTTPResponse(
            cast(socket.socket, _TimedSocket(sock, deadline)), method=method
        )
        resp.begin()
        if 300 <= resp.status < 400:
            raise NoticeError(
                f"{what}: HTTP {resp.status} redirect refused; metadata requests "
                "are never redirected"
            )
        body = resp.read(BODY_LIMIT).decode("utf-8", "replace")
        return Response(resp.status, body, dict(resp.headers))
    except TimeoutError:
        raise deadline.expired() from None
    except http.client.HTTPException as exc:
        raise NoticeError(f"{what}: not a valid HTTP answer ({type(exc).__name__})") from exc
    except OSError as exc:
        if isinstance(exc, ssl.SSLError) or exc.errno is None or exc.strerror is None:
            raise OSError(f"{what}: {exc}") from exc
        # OSError(errno, text) is the same subclass again (ConnectionRefusedError, ...)
        raise OSError(exc.errno, f"{what}: {exc.strerror}") from exc
    finally:
        if sock is not None:
            sock.close()
