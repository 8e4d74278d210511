"""Helpers shared by the benchmark scripts: machine facts, medians, a markdown table, a local
S3 server with a bucket."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path


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


S3_SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "services" / "s3.sh"


@contextlib.contextmanager
def s3_bucket(endpoint: str | None = None, bucket: str | None = None) -> Iterator[str]:
    """A bucket on moto's S3 server on 127.0.0.1 (``tests/services/s3.sh``, stopped at the end),
    or on ``endpoint`` (``bucket`` must exist there); the AWS_* variables of the standard chain
    set in this process (children inherit them). Yields the bucket's name."""
    server_dir = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    own = endpoint is None
    if endpoint is None:
        endpoint = subprocess.run(
            ["bash", str(S3_SCRIPT), "up", str(server_dir / "s3")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    name = bucket or f"bench-{uuid.uuid4().hex[:12]}"
    try:
        if bucket is None:
            request = urllib.request.Request(f"{endpoint}/{name}", method="PUT")
            urllib.request.urlopen(request, timeout=30).close()
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ALLOW_HTTP="true",
            AWS_ACCESS_KEY_ID=os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
            AWS_SECRET_ACCESS_KEY=os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
            AWS_REGION=os.environ.get("AWS_REGION", "us-east-1"),
        )
        yield name
    finally:
        if own:
            subprocess.run(["bash", str(S3_SCRIPT), "down", str(server_dir / "s3")], check=False)
        with contextlib.suppress(OSError):
            server_dir.rmdir()
