"""Bytes between staging and a bucket: a checkpoint's files walked in a fixed order, their
sha256 (the manifest's checksums), names that may not escape their directory, and a progress
bar for a large download on a terminal."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

_CHUNK = 8 * 1024 * 1024

PROGRESS_FROM = 256 * 1024 * 1024
"""Downloads of this many bytes or more show a progress bar on a terminal (stderr)."""


def sha256_file(path: Path) -> tuple[int, str]:
    """The size and sha256 (hex) of the file at ``path``."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


NAME_MAX = 255
"""Bytes in one part of a local path (Linux's, macOS's): a longer part cannot be written."""


def safe_rel(rel: str) -> bool:
    """A relative name that stays in its directory and that a local file system can hold: no
    empty, ``.`` or ``..`` part, no NUL, no part longer than ``NAME_MAX`` bytes. What a bucket
    lists came from a local file system, so anything else was not written by us, and must not
    stop a start with an error writing it (it is quarantined instead)."""
    parts = rel.split("/")
    if rel.startswith("/") or "\x00" in rel:
        return False
    try:
        return all(p not in ("", ".", "..") and len(os.fsencode(p)) <= NAME_MAX for p in parts)
    except UnicodeError:  # a lone surrogate: no file name encodes it
        return False


def walk_files(root: Path, dirs: list[str]) -> Iterator[tuple[str, Path]]:
    """Every file under ``root`` as (relative name with ``/``, path), sorted; the relative
    names of the directories are appended to ``dirs`` (an empty one is kept too)."""
    for here, subdirs, names in os.walk(root):
        subdirs.sort()
        rel_here = os.path.relpath(here, root)
        for d in subdirs:
            dirs.append(d if rel_here == "." else f"{rel_here}/{d}")
        for name in sorted(names):
            rel = name if rel_here == "." else f"{rel_here}/{name}"
            yield rel.replace(os.sep, "/"), Path(here) / name


@contextlib.contextmanager
def progress(total: int, what: str) -> Iterator[Callable[[int], None]]:
    """A progress bar on a terminal for a download of ``PROGRESS_FROM`` bytes or more."""
    if total < PROGRESS_FROM or not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.progress import DownloadColumn, Progress, TransferSpeedColumn

    with Progress(
        *Progress.get_default_columns(), DownloadColumn(), TransferSpeedColumn(), transient=True
    ) as bar:
        task = bar.add_task(f"downloading {what}", total=total)
        yield lambda n: bar.advance(task, n)
