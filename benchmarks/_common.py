"""Helpers shared by the benchmark scripts: machine facts, medians, a markdown table."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence


def machine() -> str:
    cpu = "unknown cpu"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    try:
        import torch

        torch_v = f", torch {torch.__version__}"
    except ImportError:
        torch_v = ""
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem_gb:.0f} GiB, {platform.system()} "
        f"{platform.release()}, Python {sys.version.split()[0]}{torch_v}"
    )


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def disk_of(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True).stdout
        fields = out.splitlines()[1].split()
        return f"{fields[0]} ({fields[1]})"
    except (OSError, IndexError):
        return "unknown"


_RANDOM = os.urandom(16 << 20)


def write_and_fsync(path: os.PathLike[str] | str, nbytes: int) -> None:
    """The disk's limit for ``nbytes`` of a checkpoint: the same number of random bytes written
    16 MiB a call and fsynced, nothing else (no serialization, no rename)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, memoryview(_RANDOM)[: min(left, len(_RANDOM))])
        os.fsync(fd)
    finally:
        os.close(fd)
