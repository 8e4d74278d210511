"""An atomic checkpoint store: a checkpoint exists only once it is committed.

Commit protocol (POSIX): write everything under a temporary name in the *same* directory,
fsync every file and directory written, ``rename`` to the final name, then fsync the
directory so the rename itself is durable. A reader only ever considers final names
(``step-<N>.ckpt``), so a kill at any moment leaves either the old set of checkpoints or the
old set plus one complete new one, never a half-written "latest". Older checkpoints are
pruned only after the new one is committed, so ``keep=1`` is safe as well. A checkpoint
retired by pruning is renamed aside (``.retired-<name>.<host>.<pid>.<hex>``, atomic, so no
reader ever sees half of one under its name) and removed by a thread: freeing a file's blocks
takes about 0.16 s per GB, a sixth of writing them, and the loop need not wait for it.

A checkpoint is a regular file or a directory; the store does not care what is inside.
Anything else under a checkpoint name (a FIFO, a socket, a dangling link) is not one: opening
a FIFO would block the resume forever.

The directory may be shared (NFS, Lustre, a bucket mount) between hosts, so a temporary
carries the writer's host as well as its pid: a pid only says something on its own host.
``lock()`` keeps a second writer out of the directory altogether.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

from .._errors import CheckpointLoadError, CheckpointLockError, CheckpointSaveError, ConfigError
from .._files import (
    describe_unopenable,
    fsync_dir,
    fsync_path,
    host_tag,
    open_in_place,
    pid_alive,
    remove_path,
)
from .._paths import MAX_STEP
from ._location import Location, is_url, not_a_directory, staging_dir

if TYPE_CHECKING:
    from ._mirror import Mirror

logger = logging.getLogger("preemptible")

T = TypeVar("T")

_FINAL = re.compile(r"^step-(\d+)\.ckpt$")
# .tmp-step-<N>.ckpt.<host>.<pid>.<hex>; older versions wrote no <host> (the pid is local).
_TEMP = re.compile(r"^\.tmp-step-(\d+)\.ckpt\.(?:([A-Za-z0-9-]+)\.)?(\d+)\.[0-9a-f]+$")
# .tmp-<name>.<host>.<pid>.<hex> of a checkpoint committed under a name of its own (resume.ckpt,
# checkpoint-500): the host has no dots, so the name is what comes before the last three parts
_NAMED_TEMP = re.compile(r"^\.tmp-(.+)\.([A-Za-z0-9-]+)\.(\d+)\.[0-9a-f]{8}$")
_OLD = re.compile(r"^\.old-(.+)\.[0-9a-f]+$")
# .retired-<name>.<host>.<pid>.<hex>: a pruned checkpoint a thread of <pid> is removing
_RETIRED = re.compile(r"^\.retired-(.+)\.([A-Za-z0-9-]+)\.(\d+)\.[0-9a-f]{8}$")

LOCK_NAME = ".preemptible.lock"
"""The advisory lock file of ``CheckpointStore.lock()``; it never looks like a checkpoint."""

QUARANTINE_SUFFIX = ".unloadable"
"""Appended to a checkpoint that does not load while an older one does; never deleted."""

FOREIGN_TEMP_MAX_AGE = 3600.0
"""Seconds without a write after which another host's temporary counts as abandoned.

Whether a writer on another host is alive cannot be known from here, and a live writer
touches its temporary at least once per file it writes; an hour without any write means the
writer is gone (also allows for clock skew between hosts and the file server)."""


_locked_here: set[tuple[int, int]] = set()  # (st_dev, st_ino) of lock files this process holds
_locked_here_guard = threading.Lock()


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path


def checkpoint_name(step: int) -> str:
    return f"step-{step:010d}.ckpt"


def _newest_mtime(path: Path) -> float:
    """The time of the last write anywhere in a temporary (a file or a directory tree)."""
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in [*dirs, *files]:
                with contextlib.suppress(OSError):
                    newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return newest


def _is_checkpoint_kind(path: Path) -> bool:
    try:
        mode = path.stat().st_mode  # follows links: a link to a file or directory is fine
    except OSError:
        return False
    return stat.S_ISREG(mode) or stat.S_ISDIR(mode)


def _describe_holder(fd: int) -> str:
    try:
        host, pid = os.pread(fd, 512, 0).decode("utf-8", "replace").split()
    except (OSError, ValueError):
        return "held by another process"
    return f"held by pid {pid} on host {host}"


class CheckpointStore:
    """Committed checkpoints in one directory, newest (highest step) first."""

    def __init__(
        self, directory: str | os.PathLike[str] | Location, *, keep: int = 2, create: bool = True
    ) -> None:
        """``create=False``: for a reader (a supervisor's resume lookup, ``preemptible
        runs``), which must not leave behind a directory it looked into; a missing one has no
        checkpoints.

        A URL (``s3://``, ``gs://``, ``az://``; see ``_location``, ``_mirror``) commits in local
        staging (``directory``), mirrored to the bucket; ``file:///path`` is ``/path``."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep={keep!r} is not valid; use an integer >= 1")
        self.location: Location | None = None
        self.mirror: Mirror | None = None
        if is_url(directory):
            location = Location.parse(cast("str | Location", directory))
            self.location = None if location.is_local else location
            directory = location.prefix if location.is_local else staging_dir(location)
        self.directory = Path(cast("str | os.PathLike[str]", directory))
        self.keep = keep
        self._lock_fd: int | None = None
        self._lock_key: tuple[int, int] | None = None
        self._warned_foreign: set[str] = set()
        self._pruning_deferred = False
        self._retired: list[Path] = []  # renamed aside, to be removed by ``_remover``
        self._remover: threading.Thread | None = None
        self._removals = threading.Condition()  # an async save's writer prunes too
        if self.location is not None:
            with contextlib.suppress(OSError):  # private when we make it
                self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._open_directory(True)
            from ._mirror import Mirror

            self.mirror = Mirror(self.location, self.directory, keep=keep)
            self.mirror.restore(self)
        elif create or os.path.lexists(self.directory):
            self._open_directory(create)

    def _open_directory(self, create: bool) -> None:
        problem = not_a_directory(self.directory)
        if problem:  # mkdir would say only "File exists" or "Not a directory"
            raise CheckpointSaveError(f"checkpoint directory: {problem}", self.directory)
        try:
            if create:
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
        try:  # listed (r) and its entries looked at (x): else it looks empty, a silent restart
            os.listdir(self.directory)
            os.stat(os.path.join(self.directory, "."))  # not Path: it drops the "."
        except OSError as exc:
            raise CheckpointLoadError(
                f"checkpoint directory {self.directory} cannot be read ({exc.strerror or exc}); "
                "give this user read and search (r-x) permission on it, or pass another one",
                self.directory,
            ) from exc

    # -- reading ---------------------------------------------------------------------------
    def committed(self, pattern: re.Pattern[str] = _FINAL) -> list[Checkpoint]:
        """The committed checkpoints, newest first. ``pattern``: what a checkpoint's name is
        (its first group the step): ``step-N.ckpt`` unless a saver names them otherwise."""
        found = []
        for entry in self._entries():
            m = pattern.match(entry.name)
            if m and int(m.group(1)) > MAX_STEP:
                if entry.name not in self._warned_foreign:
                    self._warned_foreign.add(entry.name)
                    logger.warning(
                        "preemptible: ignoring %s: its step does not fit a 64-bit integer",
                        entry,
                    )
            elif m and _is_checkpoint_kind(entry):
                found.append(Checkpoint(int(m.group(1)), entry))
        found.sort(key=lambda c: c.step, reverse=True)
        return found

    def latest(self) -> Checkpoint | None:
        committed = self.committed()
        return committed[0] if committed else None

    def load_newest(
        self,
        load: Callable[[Path], T],
        extra: list[Checkpoint] | None = None,
        *,
        pattern: re.Pattern[str] = _FINAL,
    ) -> tuple[Checkpoint, T] | None:
        """Load the newest checkpoint that loads; skip (with a warning) those that do not.

        Newer ones that do not load are renamed to ``<name>.unloadable`` once an older one has
        loaded: left under their names they would count as the newest for retention (and get
        the good ones pruned) and be retried on every resume. Returns None when there is no
        checkpoint at all. Raises ``CheckpointLoadError`` when checkpoints exist but none
        loads: starting over silently would throw away progress (and nothing is renamed).
        """
        candidates: dict[Path, Checkpoint] = {}
        for ckpt in [*(extra or []), *self.committed(pattern)]:
            if not _is_checkpoint_kind(ckpt.path):
                logger.warning(
                    "preemptible: ignoring %s: not an existing regular file or directory",
                    ckpt.path,
                )
                continue
            candidates.setdefault(Path(os.path.realpath(ckpt.path)), ckpt)
        ordered = sorted(candidates.values(), key=lambda c: c.step, reverse=True)
        failures: list[str] = []
        unloadable: list[Path] = []
        for ckpt in ordered:
            try:
                loaded = load(ckpt.path)
            except Exception as exc:
                logger.warning(
                    "preemptible: skipping checkpoint %s: it does not load (%s: %s)",
                    ckpt.path,
                    type(exc).__name__,
                    exc,
                )
                failures.append(f"{ckpt.path.name}: {type(exc).__name__}: {exc}")
                unloadable.append(ckpt.path)
                continue
            for path in unloadable:
                self._quarantine(path)
            return ckpt, loaded
        if failures:
            raise CheckpointLoadError(
                f"none of the {len(failures)} checkpoints in {self.directory} loads "
                f"({'; '.join(failures)}); move the broken ones away to start over",
                self.directory,
            )
        return None

    def _quarantine(self, path: Path) -> None:
        if os.path.realpath(path.parent) != os.path.realpath(self.directory):
            return  # not ours to rename (PREEMPTIBLE_RESUME_FROM elsewhere)
        target = path.with_name(path.name + QUARANTINE_SUFFIX)
        if target.exists() or target.is_symlink():
            target = path.with_name(f"{path.name}{QUARANTINE_SUFFIX}-{os.urandom(4).hex()}")
        try:
            os.rename(path, target)
        except OSError as exc:
            logger.warning(
                "preemptible: could not rename unloadable checkpoint %s to %s: %s",
                path,
                target.name,
                exc.strerror or exc,
            )
            return
        logger.warning(
            "preemptible: renamed unloadable checkpoint %s to %s (an older one loaded)",
            path,
            target.name,
        )

    # -- writing ---------------------------------------------------------------------------
    def temporary(self, step: int | str) -> Path:
        """A fresh temporary name for a checkpoint of ``step``, or one committed under the name
        ``step`` (a str); nothing is created."""
        name = step if isinstance(step, str) else checkpoint_name(step)
        return self.directory / f".tmp-{name}.{host_tag()}.{os.getpid()}.{os.urandom(4).hex()}"

    def save(self, step: int, write: Callable[[Path], None], *, tmp: Path | None = None) -> Path:
        """Commit a new checkpoint for ``step``: ``write(tmp_path)`` creates it (a file or a
        directory), then it is synced, renamed into place, and older ones are pruned.
        ``tmp``: a name from ``temporary(step)`` that other writers already use (a sharded
        checkpoint whose ranks write into it); removed as any temporary when the save fails."""
        final = self.commit(checkpoint_name(step), write, tmp=tmp)
        self.prune(step, keep_path=final)
        return final

    def commit(self, name: str, write: Callable[[Path], None], *, tmp: Path | None = None) -> Path:
        """Commit what ``write(tmp_path)`` creates under ``name`` in this directory, by the
        protocol of every checkpoint (temporary in the same directory, fsync, rename, fsync of
        the directory); an existing ``name`` is replaced only once the new one is complete.
        Nothing is pruned: a name of one's own (``resume.ckpt``) is not a ``step-N.ckpt``."""
        final = self.commit_local(name, write, tmp=tmp)
        if self.mirror is not None:
            self.mirror.enqueue(name, final)
        return final

    def commit_local(
        self, name: str, write: Callable[[Path], None], *, tmp: Path | None = None
    ) -> Path:
        """``commit`` here only, with no upload (a download committed into staging)."""
        if name in ("", ".", "..") or "/" in name or name.startswith(".tmp-"):
            raise ConfigError(f"checkpoint name {name!r} is not valid; use a plain file name")
        final = self.directory / name
        if tmp is None:
            tmp = self.temporary(name)
        try:
            write(tmp)
            if not tmp.exists():
                raise FileNotFoundError(f"the save function did not create {tmp}")
            fsync_path(tmp)
            self._commit(tmp, final)
            fsync_dir(self.directory)
        except BaseException as exc:
            remove_path(tmp)
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise CheckpointSaveError(
                f"could not save checkpoint {final}: {type(exc).__name__}: {reason}; "
                "the previous checkpoints are intact",
                final,
            ) from exc
        return final

    def _commit(self, tmp: Path, final: Path) -> None:
        if tmp.is_dir() and final.exists():
            # rename(2) cannot replace a non-empty directory: move the old one aside first.
            aside = final.with_name(f".old-{final.name}.{os.urandom(4).hex()}")
            os.rename(final, aside)
            os.rename(tmp, final)
            remove_path(aside)
        else:
            os.replace(tmp, final)

    @contextlib.contextmanager
    def pruning_deferred(self) -> Iterator[None]:
        """Saves made inside prune nothing; the next save after it prunes what they left.
        The stop's save is made inside: removing a retired checkpoint costs its unlink (about
        0.16 s per GB on ext4) in the notice window, and an unlink left to a thread would hold
        up the process's exit just as long."""
        before, self._pruning_deferred = self._pruning_deferred, True
        try:
            yield
        finally:
            self._pruning_deferred = before

    def prune(
        self,
        upto: int | None = None,
        *,
        keep_path: Path | None = None,
        pattern: re.Pattern[str] = _FINAL,
    ) -> None:
        """Keep the newest ``keep`` checkpoints at or below step ``upto`` (all when None).

        After a save, ``upto`` is the step just committed: a checkpoint with a higher step was
        not written by this run (a copied or foreign file, one that does not load), so it is
        neither counted nor deleted; counting it would prune the good ones.
        """
        if self.mirror is not None:
            self.mirror.retain(pattern)  # the bucket's retention runs after each upload
        if self._pruning_deferred:
            return
        committed = self.committed(pattern)
        if upto is not None:
            above = [c.path.name for c in committed if c.step > upto]
            if above and not set(above) <= self._warned_foreign:
                self._warned_foreign.update(above)
                logger.warning(
                    "preemptible: leaving %s in %s alone: a step above the one just saved (%d) "
                    "was not written by this run; move it away if it is stale",
                    ", ".join(sorted(above)),
                    self.directory,
                    upto,
                )
            committed = [c for c in committed if c.step <= upto]
        kept = 0 if keep_path is None else 1
        retired = []
        for ckpt in committed:
            if keep_path is not None and ckpt.path == keep_path:
                continue
            if kept < self.keep:
                kept += 1
                continue
            aside = ckpt.path.with_name(
                f".retired-{ckpt.path.name}.{host_tag()}.{os.getpid()}.{os.urandom(4).hex()}"
            )
            try:
                os.rename(ckpt.path, aside)
            except FileNotFoundError:
                continue
            except OSError as exc:
                logger.warning(
                    "preemptible: could not prune %s: %s", ckpt.path, exc.strerror or exc
                )
                continue
            retired.append(aside)
        if retired:
            self._remove_later(retired)

    def _remove_later(self, paths: list[Path]) -> None:
        """Remove ``paths`` in this store's one removing thread (started when none runs). Not
        a daemon: a run that ends waits for it at exit (so it leaves ``keep`` checkpoints),
        however it ends; a kill leaves them to the next start's ``clean_stale_temporaries``.
        Saves faster than the disk frees their predecessors queue up behind one thread."""
        with self._removals:
            self._retired.extend(paths)
            if self._remover is not None:
                return
            self._remover = threading.Thread(target=self._remove_retired, name="preemptible-prune")
            try:
                self._remover.start()
                return
            except RuntimeError:  # no thread to be had (a limit, or the interpreter exiting)
                self._remover = None
        self._remove_retired()

    def _remove_retired(self) -> None:
        while True:
            with self._removals:
                if not self._retired:
                    if self._remover is threading.current_thread():
                        self._remover = None
                    self._removals.notify_all()
                    return
                path = self._retired.pop(0)
            remove_path(path)

    def wait_for_removals(self, timeout: float | None = None) -> bool:
        """Wait until the checkpoints this store pruned are removed from the disk; True when
        they are. A finished run waits here (its directory holds ``keep`` checkpoints, no
        more); a stop does not, and its exit waits only for what periodic saves queued before
        it (the stop's save retires nothing), as the interpreter joins the removing thread."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._removals:
            while self._retired or self._remover is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._removals.wait(left)
        return True

    def clean_stale_temporaries(self) -> list[Path]:
        """Remove temporaries left by writers that no longer run (killed mid-save), and
        pruned checkpoints that a killed run had not finished removing.

        One of this host is stale when its pid is dead; one of another host (shared file
        system) only when nothing in it was written for ``FOREIGN_TEMP_MAX_AGE`` seconds.
        """
        removed = []
        me = host_tag()
        now = time.time()
        for entry in self._entries():
            m = (
                _TEMP.match(entry.name)
                or _NAMED_TEMP.match(entry.name)
                or _RETIRED.match(entry.name)
            )
            if m:
                host, pid = m.group(2), int(m.group(3))
                if host is None or host == me:
                    stale = not pid_alive(pid)
                else:
                    try:
                        stale = now - _newest_mtime(entry) > FOREIGN_TEMP_MAX_AGE
                    except OSError:  # gone meanwhile: its writer committed or cleaned it
                        stale = False
                if stale:
                    remove_path(entry)
                    removed.append(entry)
            elif old := _OLD.match(entry.name):
                final = self.directory / old.group(1)
                if final.exists():
                    remove_path(entry)
                    removed.append(entry)
                else:  # killed between the two renames of _commit: the old one is still good
                    try:
                        os.rename(entry, final)
                    except OSError as exc:
                        logger.warning("preemptible: could not restore %s: %s", entry, exc)
        if removed:
            logger.info(
                "preemptible: removed %d unfinished checkpoint file(s) in %s",
                len(removed),
                self.directory,
            )
        return removed

    # -- the writer's lock -------------------------------------------------------------------
    def lock(self) -> bool:
        """Make this store the only writer of its directory until ``unlock()`` or exit.

        An advisory ``flock`` on ``.preemptible.lock``: released by the kernel when the process
        ends, however it ends. Raises ``CheckpointLockError`` when another process, or another
        store in this process, holds it.

        The lock fails closed: when ``.preemptible.lock`` is there but is not a regular file of
        ours (a symbolic link, say to /dev/null, a FIFO, a device, a directory, a file with
        other names, one we may not open) or cannot be ``flock``ed (a file system without
        locks), it raises ``CheckpointLockError`` too, since two runs could otherwise write here
        at once. The one case that only warns and returns False is a directory in which this
        process can create nothing (a read-only mount, a directory it may not write in): no
        checkpoint of ours can land there either, so nothing can mix, and resuming from it
        still works.
        """
        if self._lock_fd is not None:
            return True
        path = self.directory / LOCK_NAME
        try:
            fd = open_in_place(path, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            if exc.errno == errno.EROFS or not os.path.lexists(path):
                logger.warning(
                    "preemptible: cannot lock checkpoint directory %s (%s): it takes no new "
                    "files, so no checkpoint can be saved there; resuming from it still works",
                    self.directory,
                    exc.strerror or exc,
                )
                return False
            raise self._unusable(path, describe_unopenable(path, exc)) from exc
        locked = False
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            with _locked_here_guard:
                # flock already refuses a second descriptor in this process on local file
                # systems, but NFS emulates it with POSIX locks, which a process shares.
                if key in _locked_here:
                    raise self._in_use(
                        f"held by another handler in this process, pid {os.getpid()}"
                    )
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                        raise self._in_use(_describe_holder(fd)) from None
                    raise CheckpointLockError(
                        f"cannot lock checkpoint directory {self.directory}: flock on {path} "
                        f"failed ({exc.strerror or exc}); keep checkpoints on a file system "
                        "with locks (a local disk, NFS with its lock service) so that two runs "
                        "cannot write there at once",
                        self.directory,
                    ) from exc
                _locked_here.add(key)
                locked = True
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
        finally:
            if not locked:
                os.close(fd)
        self._lock_fd, self._lock_key = fd, key
        if self.mirror is not None:
            try:
                self.mirror.take_over()
            except BaseException:
                self.unlock()
                raise
        return True

    def flush(self, deadline: float | None = None) -> bool:
        """A URL's ``Mirror.flush`` (``deadline``: monotonic); True at once for a directory."""
        return True if self.mirror is None else self.mirror.flush(deadline)

    def unlock(self) -> None:
        """Release the lock taken by ``lock()``; does nothing when not held. The file stays:
        removing it would let two writers lock two different files of the same name."""
        fd, key = self._lock_fd, self._lock_key
        if fd is None:
            return
        self._lock_fd = self._lock_key = None
        with _locked_here_guard:
            _locked_here.discard(key)
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the only descriptor releases the flock

    def _in_use(self, holder: str) -> CheckpointLockError:
        return CheckpointLockError(
            f"checkpoint directory {self.directory} is in use ({holder}); two runs writing to "
            "one directory would mix their checkpoints",
            self.directory,
        )

    def _unusable(self, path: Path, what: str) -> CheckpointLockError:
        return CheckpointLockError(
            f"cannot lock checkpoint directory {self.directory}: {path} is {what}; remove it "
            "(the lock is a regular file that preemptible creates) and start again",
            self.directory,
        )

    @property
    def locked(self) -> bool:
        return self._lock_fd is not None

    def _entries(self) -> Iterator[Path]:
        try:
            yield from self.directory.iterdir()
        except FileNotFoundError:
            return
