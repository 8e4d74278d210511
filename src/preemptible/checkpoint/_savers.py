"""Savers: the one interface through which a front end's checkpoints are written and found.

A front end says *how* its framework saves; the saver turns that into a committed checkpoint
through the store's protocol (temporary in the same directory, fsync, rename, fsync of the
directory), and the stop session (``preemptible.frontend``) decides *when*. Nothing else in
preemptible opens a checkpoint temporary or renames one.

The savers of one process (this module):

- ``PayloadSaver``: the state mapping as preemptible's payload (objects' state dicts, plain
  values, RNG states, the step) in ``step-N.ckpt``; with ``background=True`` the payload is
  copied to host memory at the boundary and written in a thread (``AsyncSaver``).
- ``SaveFnSaver``: ``step-N.ckpt`` written by the user's ``save_fn(path)``.
- ``NamedSaver``: a checkpoint under a name of its own, written by the framework's own save
  (Lightning's ``resume.ckpt``, the Trainer's ``checkpoint-N``).

The savers of several ranks (rank 0's full state with every rank's RNG, sharded DCP
checkpoints) live in ``preemptible.distributed``; the kit's ``StateSaver`` picks one.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

from .._errors import ConfigError
from .._files import remove_path
from ._async import AsyncSaver, holds_cuda
from ._payload import (
    StateSpec,
    apply_payload,
    build_payload,
    read_payload,
    without_crc32,
    write_payload,
)
from ._store import _FINAL, Checkpoint, CheckpointStore, checkpoint_name

logger = logging.getLogger("preemptible")

Saved = tuple[int, Path]
"""(step, path) of a committed checkpoint."""


@runtime_checkable
class Saver(Protocol):
    """How a front end's checkpoints are written and found (``preemptible.frontend``).

    ``save`` commits a checkpoint of ``step`` now (under torch.distributed every rank calls it
    at the same boundary) and returns it with whether it was written now (``reuse``: one of
    this step committed already will do). ``context`` is the front end's own description of
    the moment (what to record), passed through untouched. ``save_in_background`` starts a
    save and returns the seconds the caller was held up, or None when the save point was
    skipped; ``collect`` returns a background save that finished since the last call.
    """

    @property
    def store(self) -> CheckpointStore: ...

    @property
    def last_saved(self) -> Saved | None: ...

    @property
    def background(self) -> bool: ...

    @property
    def write_seconds(self) -> float | None: ...

    def attach(self, ranks: Any) -> None: ...

    def target(self, step: int) -> Path: ...

    def save(self, step: int, context: Any = None, *, reuse: bool = False) -> tuple[Path, bool]: ...

    def save_in_background(self, step: int, context: Any = None) -> float | None: ...

    def collect(self) -> Saved | None: ...

    def wait(self) -> None: ...

    def resume(self, hint: Path | None) -> Saved | None: ...

    def close(self) -> None: ...


class BaseSaver:
    """What every saver shares: the store, the newest committed checkpoint, and synchronous
    defaults for the background calls."""

    background = False

    def __init__(self, store: CheckpointStore) -> None:
        self._store = store
        self.last: Saved | None = None
        self.fresh: Saved | None = None  # a background save finished and not yet reported
        self.ranks: Any = None  # preemptible.distributed's Ranks under torch.distributed

    @property
    def store(self) -> CheckpointStore:
        return self._store

    @property
    def last_saved(self) -> Saved | None:
        return self.last

    @property
    def write_seconds(self) -> float | None:
        return None

    def attach(self, ranks: Any) -> None:
        """Called once by the session with the ranks (``Ranks``) or None (one process)."""
        self.ranks = ranks

    def target(self, step: int) -> Path:
        """Where a checkpoint of ``step`` goes (for the log line before it is written)."""
        return self.store.directory / checkpoint_name(step)

    def reused(self, step: int, reuse: bool) -> Path | None:
        """The committed checkpoint of ``step`` when ``reuse`` allows it."""
        if reuse and self.last is not None and self.last[0] == step:
            return self.last[1]
        return None

    def save(self, step: int, context: Any = None, *, reuse: bool = False) -> tuple[Path, bool]:
        old = self.reused(step, reuse)
        if old is not None:
            return old, False
        path = self.write(step, context)
        self.last = (step, path)
        return path, True

    def write(self, step: int, context: Any) -> Path:
        raise NotImplementedError

    def save_in_background(self, step: int, context: Any = None) -> float | None:
        started = time.monotonic()
        self.save(step, context)
        return time.monotonic() - started

    def collect(self) -> Saved | None:
        """A background save that finished since the last call (once), or None."""
        self.absorb()
        done, self.fresh = self.fresh, None
        return done

    def absorb(self) -> None:
        """Take in what the background writer finished (no background here: nothing)."""

    def wait(self) -> None:
        return None

    def resume(self, hint: Path | None) -> Saved | None:
        return None

    def close(self) -> None:
        return None


def resume_hint(path: Path | None) -> list[Checkpoint]:
    """``PREEMPTIBLE_RESUME_FROM`` as a candidate, when it names an existing ``step-N.ckpt``."""
    if path is None:
        return []
    match = _FINAL.match(path.name)
    if match is None or not (path.is_file() or path.is_dir()):
        logger.warning(
            "preemptible: ignoring PREEMPTIBLE_RESUME_FROM=%s (not an existing step-N.ckpt)", path
        )
        return []
    return [Checkpoint(int(match.group(1)), path)]


class PayloadSaver(BaseSaver):
    """``state`` as preemptible's payload in ``step-N.ckpt`` (one process)."""

    def __init__(
        self,
        store: CheckpointStore,
        state: StateSpec,
        *,
        weights_only: bool = True,
        background: bool = False,
        policy: str = "wait",
    ) -> None:
        super().__init__(store)
        self.state = state
        self.weights_only = weights_only
        self.async_saver = AsyncSaver(store, policy=policy) if background else None
        self.background = background

    @property
    def write_seconds(self) -> float | None:
        return None if self.async_saver is None else self.async_saver.write_seconds

    def write(self, step: int, context: Any) -> Path:
        payload = build_payload(step, self.state)
        if self.async_saver is not None and holds_cuda(payload):
            # the staging kept for background saves is pinned: one copy at the device-to-host
            # rate into memory already faulted in, instead of torch.save's pageable copy of
            # each storage into fresh memory (the sync save, the stop's, writes from there)
            payload = self.async_saver.snapshot.copy(payload)
        return self.store.save(step, lambda tmp: write_payload(payload, tmp))

    def save_in_background(self, step: int, context: Any = None) -> float | None:
        if self.async_saver is None:
            return super().save_in_background(step, context)
        self.absorb()
        started = time.monotonic()
        payload = build_payload(step, self.state)
        if not self.async_saver.save(step, payload, write_payload):  # the copy is made there
            return None
        return time.monotonic() - started

    def absorb(self) -> None:
        absorb_background(self, self.async_saver)

    def collect(self) -> Saved | None:
        # At the first boundary (normally after the first step, when an optimizer's state
        # exists) the staging buffers are allocated in a thread, so that the first background
        # save copies into ready memory like the later ones.
        if self.async_saver is not None and not self.async_saver.snapshot.prepared:
            self.async_saver.snapshot.prepare(build_payload(0, self.state))
        return super().collect()

    def wait(self) -> None:
        if self.async_saver is not None:
            self.async_saver.wait()

    def resume(self, hint: Path | None) -> Saved | None:
        found = self.store.load_newest(
            lambda p: read_payload(p, weights_only=self.weights_only), resume_hint(hint)
        )
        if found is None:
            return None
        ckpt, payload = found
        apply_payload(payload, self.state, ckpt.path)
        self.last = (payload["step"], ckpt.path)
        return self.last

    def close(self) -> None:
        if self.async_saver is not None:
            self.async_saver.close()  # never leave a write behind; frees the staging buffers


def absorb_background(saver: BaseSaver, async_saver: AsyncSaver | None) -> None:
    """Take what ``async_saver`` finished into ``saver.last``: the newest checkpoint (kept in
    ``saver.fresh`` until ``collect`` reports it), or its failure (logged; the previous
    checkpoints are intact). Savers call it before each save too (commit order)."""
    if async_saver is None or async_saver.in_flight is not None:
        return
    error = async_saver.take_error()
    if error is not None:
        logger.error("preemptible: background checkpoint failed: %s", error)
    done = async_saver.wait()
    newer = saver.last is None or (done is not None and done[0] >= saver.last[0])
    if done is not None and newer and saver.last != done:
        saver.last = saver.fresh = done


class SaveFnSaver(BaseSaver):
    """``step-N.ckpt`` written by ``save_fn(path)`` (a file or a directory); a resume finds the
    newest one and leaves loading it to the caller (``resume_path``)."""

    def __init__(self, store: CheckpointStore, save_fn: Callable[[Path], None]) -> None:
        super().__init__(store)
        self.save_fn = save_fn

    def write(self, step: int, context: Any) -> Path:
        return self.store.save(step, self.save_fn)

    def resume(self, hint: Path | None) -> Saved | None:
        newest = max(
            [*resume_hint(hint), *self.store.committed()], key=lambda c: c.step, default=None
        )
        if newest is None:
            return None
        self.last = (newest.step, newest.path)
        return self.last


class NamedSaver(BaseSaver):
    """A checkpoint under a name of its own, written by the framework's own save function.

    ``name``: a file or directory name in ``directory``, fixed (``resume.ckpt``: each save
    replaces it) or with ``{step}`` in it (``checkpoint-{step}``: one per save; the newest
    ``keep`` are kept, older ones pruned only after the new one is committed).
    ``write(tmp, step, context)`` writes the checkpoint at ``tmp``, a temporary name the saver
    then commits (fsync, rename, fsync of the directory). ``load(path)``: restores the
    checkpoint at ``path`` into the program and returns its step; with it, ``resume`` finds
    the newest one that loads (one that raises is skipped and set aside when an older one
    loads). Without it the framework resumes itself (Lightning's ``ckpt_path=``).
    ``writer``: whether this process writes a file (under torch.distributed every rank calls
    the framework's save, which is a collective, and rank 0 alone writes): the other processes
    call ``write`` on a temporary name and commit nothing.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | CheckpointStore,
        name: str,
        write: Callable[[Path, int, Any], None],
        *,
        load: Callable[[Path], int] | None = None,
        keep: int = 2,
        writer: bool = True,
    ) -> None:
        store = directory if isinstance(directory, CheckpointStore) else None
        if not isinstance(name, str) or not _plain_name(name.replace("{step}", "0")):
            raise ConfigError(
                f"name={name!r} is not valid; use a file name in the directory, such as "
                "'resume.ckpt' or 'checkpoint-{step}'"
            )
        if name.count("{step}") > 1:
            raise ConfigError(f"name={name!r} is not valid; put {{step}} in it once at most")
        super().__init__(store or CheckpointStore(cast(str, directory), keep=keep))
        self._name = name
        self.pattern = step_pattern(name) if "{step}" in name else None
        self._write = write
        self._load = load
        self.writer = writer

    def name(self, step: int) -> str:
        return self._name.replace("{step}", str(step))

    def target(self, step: int) -> Path:
        return self.store.directory / self.name(step)

    def write(self, step: int, context: Any) -> Path:
        name = self.name(step)
        if not self.writer:
            tmp = self.store.temporary(name)
            try:
                self._framework_writes(tmp, step, context)
            finally:
                remove_path(tmp)  # a framework that wrote on every rank: rank 0's counts
            return self.store.directory / name
        path = self.store.commit(name, lambda tmp: self._framework_writes(tmp, step, context))
        if self.pattern is not None:
            self.store.prune(step, keep_path=path, pattern=self.pattern)
        return path

    def _framework_writes(self, tmp: Path, step: int, context: Any) -> None:
        """The framework's own save (Lightning's checkpoint is one ``torch.save``), without
        the CRC32 of each record that nothing reads, as a payload is written."""
        with without_crc32():
            self._write(tmp, step, context)

    def resume(self, hint: Path | None) -> Saved | None:
        load = self._load
        if load is None:
            return None
        if self.pattern is not None:  # one per step: the newest that loads
            match = self.pattern.match(hint.name) if hint is not None else None
            extra = [Checkpoint(int(match.group(1)), cast(Path, hint))] if match else []
            found = self.store.load_newest(load, extra, pattern=self.pattern)
        else:  # the one name: it loads, or the resume fails (there is no older one)
            fixed = self.store.directory / self._name
            chosen = hint if hint is not None and hint.name == self._name else fixed
            if not (chosen.is_file() or chosen.is_dir()):
                return None
            found = self.store.load_newest(load, [Checkpoint(0, chosen)], pattern=_NOTHING)
        if found is None:
            return None
        ckpt, step = found
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"load({ckpt.path}) returned {step!r}; return the step it holds")
        self.last = (step, ckpt.path)
        return self.last


_NOTHING = re.compile(r"(?!)")  # matches no name: the candidates given are all there are


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and not name.startswith(".")


def step_pattern(name: str) -> re.Pattern[str]:
    before, _, after = name.partition("{step}")
    return re.compile(f"^{re.escape(before)}(\\d+){re.escape(after)}$")
