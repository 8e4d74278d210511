"""``preemptible status SWEEP --serve``: the sweep as a live web page, drawn on the server."""

from __future__ import annotations
