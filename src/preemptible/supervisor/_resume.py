"""Which checkpoint the next attempt of a run resumes from.

The supervisor looks where the job really saves: its own checkpoint directory, or the one
the job's record names (its handler may keep a directory of its own); and the newest
checkpoint there, ``step-N.ckpt``, or one of a framework's own name (Lightning's
``resume.ckpt``) that the record says is newer. Looking never creates a directory.

A checkpoint location that is a URL (a bucket) is not looked into here: the attempt's store
brings the newest checkpoint committed there into its staging directory when it starts, on
whichever machine it runs, so no ``PREEMPTIBLE_RESUME_FROM`` is given; the log lines name what
the record says reached the bucket last, and the stop's checkpoint when its upload did not
finish: it is kept in this machine's staging, and the next start here uploads it and resumes
from it, while another machine resumes from the bucket's.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .._errors import PreemptibleError
from ..checkpoint._location import is_url
from ..checkpoint._store import CheckpointStore
from ._record import RunRecord

logger = logging.getLogger("preemptible")


class Resumes:
    """Where the next attempt resumes from: ``directory`` (where the job saves) and the
    newest checkpoint of any name a record named there."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = directory  # a str: a bucket's URL
        self._named: tuple[int, Path] | None = None  # (step, path) the record named
        self._uploaded: str | None = None  # the newest checkpoint in the bucket, by the record
        self._staged: Path | None = None  # a bucket's newer checkpoint kept in local staging
        self._said: Path | None = None  # the job's own directory, said once per run

    def said_before(self, record: RunRecord) -> None:
        """An earlier ``preemptible run`` of this run ended with ``record``: the directory it
        names was said then, and is not said again by this one (once per run, not per rerun
        of the command)."""
        if record.checkpoint_dir is not None and not is_url(record.checkpoint_dir):
            self._said = Path(record.checkpoint_dir).resolve()

    def target(self) -> Path | None:
        """The checkpoint the next attempt resumes from: the newest ``step-N.ckpt`` of the
        directory, or the one the job's record names when it is newer (OSError or a
        PreemptibleError when the directory cannot be read). None for a bucket: the attempt
        finds its newest checkpoint itself."""
        if isinstance(self.directory, str):
            return None
        latest = CheckpointStore(self.directory, create=False).latest()
        named = self._named
        if named is not None and not (named[1].is_file() or named[1].is_dir()):
            named = None
        if named is not None and (latest is None or named[0] > latest.step):
            return named[1]
        return None if latest is None else latest.path

    def newest_name(self) -> str:
        """The checkpoint the next attempt would resume from, for a log line."""
        if isinstance(self.directory, str):
            uploaded = self._uploaded or f"the newest in {self.directory}"
            staged = self._staged
            if staged is None or not (staged.is_file() or staged.is_dir()):
                return uploaded
            return (
                f"{staged.name}, kept in {staged.parent} (its upload did not finish: the next "
                f"start on this machine uploads it; another machine resumes from {uploaded})"
            )
        try:
            latest = self.target()
        except (OSError, PreemptibleError):
            return "unknown"
        return "none" if latest is None else latest.name

    def follow(self, record: RunRecord) -> None:
        """Resume from where the job says it saves (its handler may have a directory of its
        own), when that is an existing directory; else keep the supervisor's. The newest
        checkpoint it names counts when it lies in that directory."""
        if record.remote_checkpoint is not None:
            self._uploaded = record.remote_checkpoint
        if record.checkpoint_dir is not None and is_url(record.checkpoint_dir):
            # the attempt's newest checkpoint (in staging), when it is not the bucket's newest
            staged = Path(record.checkpoint) if record.checkpoint else None
            uploaded = (record.remote_checkpoint or "").rsplit("/", 1)[-1]
            if staged is not None and staged.is_absolute() and staged.name != uploaded:
                self._staged = staged
            elif record.remote_checkpoint is not None:
                self._staged = None
            if record.checkpoint_dir != self.directory:
                logger.info(
                    "preemptible: the job keeps its checkpoints in %s, not in %s",
                    record.checkpoint_dir,
                    self.directory,
                )
                self.directory = record.checkpoint_dir
            return
        if record.resume_from is not None and record.checkpoint_dir is not None:
            named = Path(record.resume_from)
            if named.is_absolute() and named.parent == Path(record.checkpoint_dir):
                self._named = (record.resume_step or 0, named)
        if record.checkpoint_dir is None:
            return
        where = Path(record.checkpoint_dir)
        if not where.is_absolute() or not where.is_dir():
            return
        if isinstance(self.directory, Path) and where.resolve() == self.directory.resolve():
            return  # the same directory (--checkpoint-dir ckpt, the job's ckpt/)
        if where.resolve() != self._said:
            self._said = where.resolve()
            logger.info(
                "preemptible: the job keeps its checkpoints in %s, not in %s",
                where,
                self.directory,
            )
        self.directory = where
