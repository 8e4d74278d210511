"""``preemptible status SWEEP --serve``: the sweep as a live web page, drawn on the server."""

from __future__ import annotations

from ._server import DEFAULT_PORT, check_port, serve_status

__all__ = ["DEFAULT_PORT", "check_port", "serve_status"]
