"""An atomic checkpoint store: a checkpoint exists only once it is committed.

Commit protocol (POSIX): write everything under a temporary name in the *same* directory,
fsync every file and directory written, ``rename`` to the final name, then fsync the
directory so the rename itself is durable. A reader only ever considers final names
(``step-<N>.ckpt``), so a kill at any moment leaves either the old set of checkpoints or the
old set plus one complete new one, never a half-written "latest". Older checkpoints are
pruned only after the new one is committed, so ``keep=1`` is safe as well.

A checkpoint is a file or a directory; the store does not care what is inside.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ._errors import CheckpointLoadError, CheckpointSaveError, ConfigError

logger = logging.getLogger("preemptible")

T = TypeVar("T")

_FINAL = re.compile(r"^step-(\d+)\.ckpt$")
_TEMP = re.compile(r"^\.tmp-step-(\d+)\.ckpt\.(\d+)\.[0-9a-f]+$")
_OLD = re.compile(r"^\.old-(step-\d+\.ckpt)\.[0-9a-f]+$")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path


def checkpoint_name(step: int) -> str:
    return f"step-{step:010d}.ckpt"


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory tree and every file in it."""
    if path.is_dir():
        for root, _dirs, files in os.walk(path):
            for name in files:
                _fsync_fd_of(Path(root) / name, os.O_RDONLY)
            _fsync_fd_of(Path(root), os.O_RDONLY | os.O_DIRECTORY)
    else:
        _fsync_fd_of(path, os.O_RDONLY)


def fsync_dir(path: Path) -> None:
    _fsync_fd_of(path, os.O_RDONLY | os.O_DIRECTORY)


def _fsync_fd_of(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Best effort: used on error paths, where the original error is the one to report."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CheckpointStore:
    """Committed checkpoints in one directory, newest (highest step) first."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 2) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep={keep!r} is not valid; use an integer >= 1")
        self.directory = Path(directory)
        self.keep = keep
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointSaveError(
                f"checkpoint directory {self.directory} cannot be created: {exc.strerror or exc}",
                self.directory,
            ) from exc
        if not self.directory.is_dir():
            raise CheckpointSaveError(
                f"checkpoint directory {self.directory} exists but is not a directory",
                self.directory,
            )

    # -- reading ---------------------------------------------------------------------------
    def committed(self) -> list[Checkpoint]:
        found = []
        for entry in self._entries():
            m = _FINAL.match(entry.name)
            if m:
                found.append(Checkpoint(int(m.group(1)), entry))
        found.sort(key=lambda c: c.step, reverse=True)
        return found

    def latest(self) -> Checkpoint | None:
        committed = self.committed()
        return committed[0] if committed else None

    def load_newest(
        self, load: Callable[[Path], T], extra: list[Checkpoint] | None = None
    ) -> tuple[Checkpoint, T] | None:
        """Load the newest checkpoint that loads; skip (with a warning) those that do not.

        Returns None when there is no checkpoint at all. Raises ``CheckpointLoadError`` when
        checkpoints exist but none loads: starting over silently would throw away progress.
        """
        candidates = {c.path: c for c in [*(extra or []), *self.committed()]}
        ordered = sorted(candidates.values(), key=lambda c: c.step, reverse=True)
        failures: list[str] = []
        for ckpt in ordered:
            try:
                return ckpt, load(ckpt.path)
            except Exception as exc:
                logger.warning(
                    "preemptible: skipping checkpoint %s: it does not load (%s: %s)",
                    ckpt.path,
                    type(exc).__name__,
                    exc,
                )
                failures.append(f"{ckpt.path.name}: {type(exc).__name__}: {exc}")
        if failures:
            raise CheckpointLoadError(
                f"none of the {len(failures)} checkpoints in {self.directory} loads "
                f"({'; '.join(failures)}); move the broken ones away to start over",
                self.directory,
            )
        return None

    # -- writing ---------------------------------------------------------------------------
    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """Commit a new checkpoint for ``step``: ``write(tmp_path)`` creates it (a file or a
        directory), then it is synced, renamed into place, and older ones are pruned."""
        final = self.directory / checkpoint_name(step)
        tmp = self.directory / f".tmp-{final.name}.{os.getpid()}.{os.urandom(4).hex()}"
        try:
            write(tmp)
            if not tmp.exists():
                raise FileNotFoundError(f"the save function did not create {tmp}")
            fsync_path(tmp)
            self._commit(tmp, final)
            fsync_dir(self.directory)
        except BaseException as exc:
            _remove(tmp)
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise CheckpointSaveError(
                f"could not save checkpoint {final}: {type(exc).__name__}: {reason}; "
                "the previous checkpoints are intact",
                final,
            ) from exc
        self.prune()
        return final

    def _commit(self, tmp: Path, final: Path) -> None:
        if tmp.is_dir() and final.exists():
            # rename(2) cannot replace a non-empty directory: move the old one aside first.
            aside = final.with_name(f".old-{final.name}.{os.urandom(4).hex()}")
            os.rename(final, aside)
            os.rename(tmp, final)
            _remove(aside)
        else:
            os.replace(tmp, final)

    def prune(self) -> None:
        for ckpt in self.committed()[self.keep :]:
            try:
                _remove(ckpt.path)
            except OSError as exc:  # pragma: no cover - best effort
                logger.warning("preemptible: could not prune %s: %s", ckpt.path, exc)

    def clean_stale_temporaries(self) -> list[Path]:
        """Remove temporaries left by writers that no longer run (killed mid-save)."""
        removed = []
        for entry in self._entries():
            m = _TEMP.match(entry.name)
            if m and not _pid_alive(int(m.group(2))):
                _remove(entry)
                removed.append(entry)
            elif old := _OLD.match(entry.name):
                final = self.directory / old.group(1)
                if final.exists():
                    _remove(entry)
                    removed.append(entry)
                else:  # killed between the two renames of _commit: the old one is still good
                    os.rename(entry, final)
        if removed:
            logger.info(
                "preemptible: removed %d unfinished checkpoint file(s) in %s",
                len(removed),
                self.directory,
            )
        return removed

    def _entries(self) -> Iterator[Path]:
        try:
            yield from self.directory.iterdir()
        except FileNotFoundError:
            return
