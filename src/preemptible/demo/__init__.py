"""``preemptible demo``: a small training run stopped and resumed, and a sweep demo on it."""

from __future__ import annotations

from ._sweep import run_sweep_demo

__all__ = ["run_sweep_demo"]
