"""``preemptible doctor``: what this machine and job can do about a stop, checked."""

from __future__ import annotations

from ._doctor import diagnose

__all__ = ["diagnose"]
