"""A minimal HTTP client for metadata servers: no proxies, short timeouts, no dependencies."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

# Metadata servers live on link-local or local addresses; a corporate proxy must never see
# (or delay) these requests.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Response:
    status: int
    body: str
    headers: dict[str, str]


def request(
    method: str,
    url: str,
    *,
    headers: dict[str, str] | None = None,
    data: bytes | None = None,
    timeout: float = 2.0,
) -> Response:
    """One request; HTTP error statuses are returned, network errors raise ``OSError``."""
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with _opener.open(req, timeout=timeout) as resp:
            body = resp.read(1 << 20).decode("utf-8", "replace")
            return Response(resp.status, body, dict(resp.headers))
    except urllib.error.HTTPError as exc:
        body = exc.read(1 << 16).decode("utf-8", "replace") if exc.fp else ""
        return Response(exc.code, body, dict(exc.headers or {}))


def base_url(value: str) -> str:
    """Accept ``host[:port]`` or a full URL; return ``scheme://host[:port]`` without a slash."""
    value = value.strip().rstrip("/")
    return value if "://" in value else f"http://{value}"
