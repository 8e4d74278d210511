"""Files in states a test needs: one that cannot be removed, one touched anew."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def unremovable(directory: Path) -> Iterator[None]:
    """No entry of ``directory`` can be removed, by this user either (root: chattr +i)."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", directory], capture_output=True).returncode:
        pytest.skip("running as root without chattr +i: no directory is read-only to us")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", directory], check=True)


def touch_later(path: Path) -> None:
    """A new modification time, certainly different from the last one."""
    ns = path.stat().st_mtime_ns + 1_000_000_000
    os.utime(path, ns=(ns, ns))
