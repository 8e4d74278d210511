"""The ``preemptible`` command line: the group, ``run``, ``runs`` and the sweep commands."""

from __future__ import annotations

from ._main import main

__all__ = ["main"]
