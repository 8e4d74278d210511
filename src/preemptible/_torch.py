"""torch, only when the program already imported it: preemptible never imports torch itself
on the stop path (a CPU-only job, a job of another framework, must not pay for it)."""

from __future__ import annotations

import sys
from typing import Any


def initialized_dist() -> Any | None:
    """``torch.distributed`` when torch is imported and its default process group is
    initialized; else None (also for a half-initialized or destroyed group)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist
    except Exception:  # pragma: no cover - a half-initialized or destroyed group
        pass
    return None
