"""``preemptible status``: the sweep read from the queue as JSON documents, drawn as tables and a
timeline."""

from __future__ import annotations
