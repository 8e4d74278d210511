"""The mirror of a checkpoint URL: committed checkpoints go up to the bucket, and come back.

A URL never reaches the POSIX commit: a store for ``s3://bucket/prefix`` commits every save in
a local staging directory (``_location.staging_dir``) exactly as for any directory, and this
mirror uploads each committed checkpoint in a background thread by the bucket's own commit
protocol (``_remote``), and at start brings the newest one committed in the bucket back into
staging when staging has nothing as new (verified; committed into staging by the POSIX
commit, so a kill during the download leaves only a temporary).

Uploads run one at a time: a checkpoint committed while another is uploading waits, and a
newer one replaces a waiting older one (which is then never uploaded; the bucket keeps its
previous ones). The retention of older ones in the bucket after each upload runs in a
thread of its own, so that deletes answered slowly never hold up an upload (the stop's above
all); a run that ends waits for it at its exit, a stop does not. The committed checkpoint is
hard-linked into ``.upload-*`` in staging first, so the local retention may remove it
meanwhile. A failed upload is logged once; the next save uploads anew. ``flush`` waits for
the queue with a deadline; a stop flushes by its notice's deadline (``upload_deadline``), and
a normal interpreter exit flushes every mirror of the process (``atexit``, up to
``EXIT_FLUSH_SECONDS``).

Staging remembers, in ``.preemptible-mirror.json``, where each local checkpoint came from or
went up as (a manifest's key), or when it was committed here and not yet uploaded: that is how
a start knows that staging has the bucket's newest already, or something newer. A writer's
start (``take_over``) uploads the newest one never uploaded, unless the bucket has one as new:
a run killed, or whose exit stopped waiting, before its last upload leaves it only here.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import CheckpointRemoteError, PreemptibleError
from .._files import host_tag, open_in_place, pid_alive, remove_path, write_text_atomic
from .._run import current_run
from ..stop._launcher import elastic_kill_after
from ._buckets import first_line
from ._location import Location
from ._manifest import Remote
from ._remote import RemoteCheckpoints

if TYPE_CHECKING:
    from ..stop._termination import StopRequests

logger = logging.getLogger("preemptible")

STATE_NAME = ".preemptible-mirror.json"
RESTORE_LOCK = ".preemptible-restore.lock"
SNAPSHOT_PREFIX = ".upload-"

EXIT_FLUSH_SECONDS = 600.0
"""How long a normal interpreter exit (or a stop without a deadline) waits for uploads."""

EXIT_MARGIN = 1.0
"""Seconds kept, before a notice's deadline, for the process to exit after the upload."""

_FINAL = re.compile(r"^step-(\d+)\.ckpt$")

_SLICE = 0.2  # seconds: how late a signal may be acted on while a flush waits


class Staging(Protocol):
    """What the mirror needs of its store (``CheckpointStore``)."""

    def commit_local(self, name: str, write: Callable[[Path], None]) -> Path: ...

    def committed(self, pattern: re.Pattern[str]) -> list[Any]: ...


@dataclass
class _Job:
    name: str
    snapshot: Path
    queued: float = field(default_factory=time.monotonic)
    committed: bool = False  # its manifest is in the bucket (retention may still run)
    started: float | None = None  # when its upload began (time.monotonic())


_mirrors: weakref.WeakSet[Mirror] = weakref.WeakSet()
_exit_registered = False
_exit_flushed = False
_registry_guard = threading.Lock()


@contextlib.contextmanager
def _one_restore_at_a_time(staging: Path) -> Iterator[None]:
    """Hold ``RESTORE_LOCK`` in staging while bringing checkpoints back. The processes of one
    machine share its staging directory (``accelerate launch``'s or torchrun's, one store
    each): the first brings the bucket's newest back and the others, waiting here, find it
    there. Without it every process downloaded it, and each later commit of the same name
    moved the copy before it aside, possibly while another process was loading it. Where the
    file cannot be made or locked, each process restores on its own, as without it."""
    try:
        fd = open_in_place(staging / RESTORE_LOCK, os.O_RDWR | os.O_CREAT)
    except OSError:
        fd = None
    try:
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)  # released when the fd closes
        yield
    finally:
        if fd is not None:
            os.close(fd)


class Mirror:
    """Uploads a staging directory's committed checkpoints to ``location``; brings the newest
    back. One per ``CheckpointStore`` of a URL. Raises ``CheckpointRemoteError`` at
    construction when the bucket cannot be used."""

    def __init__(self, location: Location, staging: Path, *, keep: int) -> None:
        self.location = location
        self.staging = staging
        self.remote = RemoteCheckpoints(location, keep=keep)
        self._cond = threading.Condition()
        self._pending: _Job | None = None
        self._active: _Job | None = None
        self._thread: threading.Thread | None = None
        self._patterns: list[re.Pattern[str]] = [_FINAL]
        self.uploaded: str | None = None  # the newest name this process put in the bucket
        self.newest_remote: str | None = None  # the newest committed one seen in the bucket
        self.failed: str | None = None  # why the last upload failed, until one succeeds
        self.upload_seconds: float | None = None  # how long the last upload took (measured)
        self._remotes: list[Remote] = []  # the bucket's committed ones, newest first (restore)
        self.kept_here: str | None = None  # the newest committed after a takeover fenced us
        # the newest upload of each family of names whose retention is still to run
        self._retire: dict[str, str] = {}
        self._retainer: threading.Thread | None = None
        _register(self)

    def __repr__(self) -> str:
        return f"Mirror({self.location})"

    def take_over(self) -> None:
        """Become the location's writer (``RemoteCheckpoints.take_over``); remove the upload
        snapshots of this host's dead processes; upload what an earlier run committed here and
        never uploaded."""
        self.remote.take_over()
        me = host_tag()
        for entry in self.staging.glob(f"{SNAPSHOT_PREFIX}*"):
            parts = entry.name[len(SNAPSHOT_PREFIX) :].split(".")
            mine = len(parts) == 3 and parts[0] == me and parts[1].isdecimal()
            if mine and not pid_alive(int(parts[1])):
                remove_path(entry)
        unsent = self._unsent()
        if unsent is not None:
            logger.warning(
                "preemptible: uploading %s to %s: an earlier run committed it in %s and exited "
                "before its upload finished",
                unsent,
                self.location,
                self.staging,
            )
            self.enqueue(unsent, self.staging / unsent)

    def _unsent(self) -> str | None:
        """The newest checkpoint committed in staging and never uploaded, when the bucket holds
        nothing as new of its family: a run killed, or whose exit stopped waiting, before its
        last upload was done. Left there, a run that had finished would say so on this machine
        and never upload it, and a new machine would resume from an older one."""
        newest: tuple[float, str] | None = None
        for name, mark in self._read_state().items():
            if not (isinstance(mark, dict) and isinstance(mark.get("local"), int | float)):
                continue  # uploaded (its key), or brought back
            path = self.staging / name
            if not (path.is_file() or path.is_dir()) or self._bucket_as_new(name, mark):
                continue
            if newest is None or float(mark["local"]) > newest[0]:
                newest = (float(mark["local"]), name)
        return None if newest is None else newest[1]

    def _bucket_as_new(self, name: str, mark: dict[str, Any]) -> bool:
        """Whether the bucket holds ``name`` committed since it was here, or a newer one of its
        family (the bucket's committed ones as ``restore`` read them)."""
        family, pattern = _family(name)
        for remote in self._remotes:  # newest first
            if _family(remote.name)[0] != family:
                continue
            if remote.name == name:  # without its time, taken as newer: no upload over it
                committed_at = _committed_at(remote)
                return committed_at is None or committed_at >= float(mark["local"])
            m = pattern.match(name) if pattern is not None else None
            r = pattern.match(remote.name) if pattern is not None else None
            if m is None or r is None or int(r.group(1)) >= int(m.group(1)):
                return True
        return False

    # -- bringing the newest back --------------------------------------------------------------
    def restore(self, store: Staging) -> list[Path]:
        """Bring the newest committed checkpoint of each family of names (``step-N.ckpt``,
        ``checkpoint-N``, ``resume.ckpt``: a name with its last number as the step) into
        staging, unless staging has one as new; one that does not verify is quarantined and
        the next older one of its family is tried. Returns what was brought back."""
        try:
            remotes = self.remote.committed()
        except CheckpointRemoteError:
            raise  # its own line already
        except Exception as exc:
            raise self.remote.refused(exc) from None
        if not remotes:
            return []
        with _one_restore_at_a_time(self.staging):
            brought, quarantined = self._restore(remotes, store)
        self._remotes = [r for r in remotes if r.name not in quarantined]
        self.newest_remote = self._remotes[0].name if self._remotes else None
        return brought

    def _restore(self, remotes: list[Remote], store: Staging) -> tuple[list[Path], set[str]]:
        """What was brought back, and the names quarantined on the way."""
        families: dict[str, list[Remote]] = {}
        for remote in remotes:  # newest first, so is each family's list
            families.setdefault(_family(remote.name)[0], []).append(remote)
        brought = []
        quarantined = set()
        for members in families.values():
            for remote in members:
                if self._staging_as_new(remote, store):
                    break
                path = self.remote.bring_back(remote, store.commit_local)
                if path is None:  # it did not verify: quarantined, try the next older one
                    quarantined.add(remote.name)
                    continue
                self._mark(remote.name, remote.key)
                logger.warning(
                    "preemptible: brought %s back from %s into %s",
                    remote.name,
                    self.location,
                    self.staging,
                )
                brought.append(path)
                break
        return brought, quarantined

    def _staging_as_new(self, remote: Remote, store: Staging) -> bool:
        """Whether staging holds this very checkpoint, or a newer one of its family."""
        mark = self._read_state().get(remote.name)
        if os.path.lexists(self.staging / remote.name):
            if mark == remote.key:
                return True
            if isinstance(mark, dict) and "local" in mark:  # committed here, maybe not uploaded
                # without its time, taken as older: no download over the local one
                return float(mark["local"]) >= (_committed_at(remote) or 0.0)
        _key, pattern = _family(remote.name)
        m = pattern.match(remote.name) if pattern is not None else None
        if pattern is None or m is None:
            return False
        return any(c.step >= int(m.group(1)) for c in store.committed(pattern))

    # -- state of staging ----------------------------------------------------------------------
    def _read_state(self) -> dict[str, Any]:
        try:
            data = json.loads((self.staging / STATE_NAME).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _mark(self, name: str, value: Any) -> None:
        with self._cond:  # one writer of the state file in this process
            state = self._read_state()
            state[name] = value
            live = {p.name for p in self.staging.iterdir()} if self.staging.is_dir() else set()
            try:
                write_text_atomic(
                    self.staging / STATE_NAME,
                    json.dumps({k: v for k, v in state.items() if k in live}),
                )
            except OSError as exc:  # only costs a download at the next start
                logger.info("preemptible: could not note %s in %s: %s", name, self.staging, exc)

    # -- uploading -----------------------------------------------------------------------------
    def enqueue(self, name: str, path: Path) -> None:
        """Upload the checkpoint just committed at ``path`` (in the background)."""
        self._mark(name, {"local": time.time()})
        if self.remote.fenced:
            self.kept_here = name
            return
        snapshot = self._snapshot(path)
        with self._cond:
            superseded, self._pending = self._pending, _Job(name, snapshot)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="preemptible-upload", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
        if superseded is not None:
            logger.info("preemptible: %s is not uploaded: %s replaces it", superseded.name, name)
            remove_path(superseded.snapshot.parent)

    def retain(self, pattern: re.Pattern[str]) -> None:
        """After each upload of a name ``pattern`` matches, keep the newest ``keep`` of them in
        the bucket (at or below the uploaded step)."""
        with self._cond:
            if pattern not in self._patterns:
                self._patterns.append(pattern)

    def _snapshot(self, path: Path) -> Path:
        holder = self.staging / (
            f"{SNAPSHOT_PREFIX}{host_tag()}.{os.getpid()}.{os.urandom(4).hex()}"
        )
        holder.mkdir()
        target = holder / path.name
        try:
            if path.is_dir():
                shutil.copytree(path, target, copy_function=_link_or_copy, symlinks=False)
            else:
                _link_or_copy(str(path), str(target))
        except BaseException:
            remove_path(holder)
            raise
        return target

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                job, self._pending = self._pending, None
                self._active = job
            try:
                self._upload(job)
            except Exception as exc:
                self.failed = f"{type(exc).__name__}: {first_line(exc)}"
                logger.warning(
                    "preemptible: upload of %s to %s failed (%s); the next save uploads again; "
                    "the newest checkpoint in the bucket is %s",
                    job.name,
                    self.location,
                    self.failed,
                    self.newest_in_bucket(),
                )
            finally:
                remove_path(job.snapshot.parent)
                with self._cond:
                    self._active = None
                    self._cond.notify_all()

    def _upload(self, job: _Job) -> None:
        started = job.started = time.monotonic()
        key = self.remote.upload(job.name, job.snapshot)
        self.upload_seconds = time.monotonic() - started
        if key is None:  # fenced: said once; no upload of this process counts any more
            self.failed = f"another writer took over {self.location}"
            self.kept_here = job.name
            return
        self.failed = self.kept_here = None
        self.uploaded = self.newest_remote = job.name
        self._mark(job.name, key)
        logger.info("preemptible: uploaded %s to %s", job.name, self.location)
        from .. import _run

        _run.update_record(remote_checkpoint=f"{self.location}/{job.name}")
        remove_path(job.snapshot.parent)  # up: the retention does not need it
        with self._cond:  # a flush waits no longer: the retention of older ones may lag
            job.committed = True
            # The retention runs in a thread of its own: deletes the bucket answers slowly
            # (throttled) must not hold up the next upload, the stop's least of all.
            self._retire[_family(job.name)[0]] = job.name
            if self._retainer is None:
                self._retainer = threading.Thread(
                    target=self._retain, name="preemptible-retention", daemon=True
                )
                self._retainer.start()
            self._cond.notify_all()

    def _retain(self) -> None:
        """Keep ``keep`` in the bucket after each upload: of each family of names, the newest
        upload's retention only, when uploads come faster than the deletes."""
        while True:
            with self._cond:
                if not self._retire:
                    self._retainer = None
                    self._cond.notify_all()
                    return
                name = self._retire.pop(next(iter(self._retire)))
                patterns = list(self._patterns)
            try:
                self.remote.retire_after(name, patterns)
            except Exception as exc:  # the commit stands; the next upload retires again
                logger.info(
                    "preemptible: retention in %s postponed: %s", self.location, first_line(exc)
                )

    # -- waiting -------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether a checkpoint is queued or going up (its retention afterwards is not
        waited for: an exit that leaves it half done leaves files without a manifest, which
        the next takeover cleans, never a manifest without files)."""
        active = self._active
        return self._pending is not None or (active is not None and not active.committed)

    def upload_estimate(self) -> float | None:
        """How long an upload takes, as known now: the last one measured, or the time the one
        going up has taken so far when that is longer (the first upload, still under way, is
        already a lower bound); None before any upload began."""
        active = self._active
        running = None
        if active is not None and active.started is not None and not active.committed:
            running = time.monotonic() - active.started
        known = [s for s in (self.upload_seconds, running) if s is not None]
        return max(known) if known else None

    @property
    def idle(self) -> bool:
        """Nothing queued, going up, or being retired after an upload."""
        return self._pending is None and self._active is None and self._retainer is None

    def settle(self, deadline: float) -> bool:
        """Wait, until ``deadline`` (``time.monotonic()``), for the uploads and the retention
        after the last one: a run that ends leaves ``keep`` checkpoints in the bucket, not one
        more for good. True when nothing is left to do."""
        with self._cond:
            while not self.idle:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, _SLICE))
        return True

    def newest_in_bucket(self) -> str:
        return self.newest_remote or "none"

    def flush(self, deadline: float | None = None, *, say: bool = False) -> bool:
        """Wait until every queued upload is done (``deadline``: ``time.monotonic()`` value).
        False, with one line naming the newest checkpoint in the bucket, when the deadline
        passed first or the last upload failed. ``say``: the process exits after this wait
        (a stop, the interpreter's exit), so a line says what it waits for, and another what
        reached the bucket: between the stop's line and the exit the process would otherwise
        be silent for as long as the network takes."""
        with self._cond:
            waited = self._pending or self._active if self.busy else None
        announced = waited if say else None  # what a line says this exit waits for
        if announced is not None:
            from ..stop._latch import note_for_exit

            # set before the line: a signal that answers it finds it
            note_for_exit(
                f"; {announced.name} is not in {self.location} (the newest there is "
                f"{self.newest_in_bucket()}): it stays in {self.staging}, and the next start "
                "on this machine uploads it"
            )
            left = ""
            if deadline is not None:
                left = f" up to {max(0.0, deadline - time.monotonic()):.0f} s"
            logger.warning(
                "preemptible: waiting%s for the upload of %s to %s before exiting (a signal now "
                "exits at once without it; the newest checkpoint in the bucket is %s)",
                left,
                announced.name,
                self.location,
                self.newest_in_bucket(),
            )
        try:
            done = self._wait(deadline)
        finally:
            if announced is not None:
                note_for_exit("")
        if say and self.kept_here is not None:  # the process exits: its checkpoint stays here
            logger.error(
                "preemptible: %s is not in %s: another writer took the location over, so this "
                "run's checkpoints since stay in %s; the newest this run put there is %s",
                self.kept_here,
                self.location,
                self.staging,
                self.uploaded or "none",
            )
            self.kept_here = None
            return False
        if announced is not None and done:
            logger.warning("preemptible: uploaded %s to %s", self.uploaded, self.location)
        return done

    def _wait(self, deadline: float | None) -> bool:
        with self._cond:
            while self.busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    waiting = self._pending or self._active
                    logger.warning(
                        "preemptible: the upload of %s to %s did not finish in time; the newest "
                        "checkpoint in the bucket is %s",
                        waiting.name if waiting else "?",
                        self.location,
                        self.newest_in_bucket(),
                    )
                    return False
                # in slices: a signal the kernel gives to another thread (obstore's, the
                # uploader) only marks it pending, and the main thread runs its Python handler
                # (a second SIGTERM: exit at once) when it next runs code, not in this wait
                self._cond.wait(_SLICE if left is None else min(left, _SLICE))
        return self.failed is None


def probe(location: Location, seconds: float) -> PreemptibleError | None:
    """What a run's start meets at ``location`` (``RemoteCheckpoints``, which writes nothing), in
    a daemon thread that is waited for ``seconds`` at most: None when the bucket answered, else
    the run's one line as an error; a client's own error by its first line, and no answer in
    time, are a ``CheckpointRemoteError`` without a ``reason`` (they may pass by themselves)."""
    outcome: list[PreemptibleError | None] = []

    def check() -> None:
        try:
            RemoteCheckpoints(location, keep=1)
            outcome.append(None)
        except PreemptibleError as exc:
            outcome.append(exc)
        except Exception as exc:
            outcome.append(
                CheckpointRemoteError(f"checkpoint location {location}: {first_line(exc)}", None)
            )

    thread = threading.Thread(target=check, name="preemptible-bucket-probe", daemon=True)
    thread.start()
    thread.join(seconds)
    if outcome:
        return outcome[0]
    return CheckpointRemoteError(
        f"checkpoint location {location}: no answer within {seconds:g} s", None
    )


def _committed_at(remote: Remote) -> float | None:
    """When ``remote`` was committed (its manifest's ``committed_at``), None when it says not."""
    value = remote.body.get("committed_at")
    return float(value) if isinstance(value, int | float) else None


def _family(name: str) -> tuple[str, re.Pattern[str] | None]:
    """A name's family: its last run of digits is the step (``checkpoint-500`` ->
    ``checkpoint-#``, with a pattern that reads the step back); a name without digits is a
    family of its own."""
    runs = list(re.finditer(r"\d+", name))
    if not runs:
        return name, None
    last = runs[-1]
    before, after = name[: last.start()], name[last.end() :]
    return f"{before}#{after}", re.compile(f"^{re.escape(before)}(\\d+){re.escape(after)}$")


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def _register(mirror: Mirror) -> None:
    global _exit_registered
    with _registry_guard:
        _mirrors.add(mirror)
        if not _exit_registered:
            _exit_registered = True
            atexit.register(_flush_at_exit)


def flush_all(deadline: float | None = None, *, final: bool = False) -> bool:
    """Flush every mirror of this process (see ``Mirror.flush``); True when all are done.
    ``final``: the process exits next (a stop): each busy mirror says what it waits for and
    what reached the bucket, and when this flush gave up, the exit does not wait again."""
    global _exit_flushed
    ok = True
    for mirror in list(_mirrors):
        ok = mirror.flush(deadline, say=final) and ok
    if final and not ok:
        _exit_flushed = True
    return ok


def upload_deadline(requests: StopRequests) -> float:
    """How long a stop waits for its upload (a ``time.monotonic()`` value): at most
    ``EXIT_FLUSH_SECONDS``, and ``EXIT_MARGIN`` before the first of

    - the notice's deadline when it has one (a platform's notice, a grace period);
    - under a supervisor, its SIGKILL of the attempt's group, ``current_run().kill_after``
      after the first stop signal's receipt: the supervisor passes a signal on and escalates
      by its term timeout, whether the stop has a deadline of its own (which may be later) or
      none (a plain SIGTERM). A stop by no signal (a stop file) has no kill coming.
    - in a worker of torch's elastic agent (torchrun), the agent's SIGKILL of its workers,
      its shutdown timeout after it passed the signal on (``elastic_kill_after``).

    So the process says which checkpoint reached the bucket and exits by itself."""
    now = time.monotonic()
    ends = [now + EXIT_FLUSH_SECONDS]
    timed = [n for n in requests.stopping if n.deadline is not None]
    if timed or requests.grace_period is not None:
        wall = requests.deadline()
        if wall is not None:
            ends.append(now + (wall - time.time()) - EXIT_MARGIN)
    signalled = [n for n in requests.stopping if n.signum is not None]
    kills = [k for k in (current_run().kill_after, elastic_kill_after()) if k is not None]
    kill_after = min(kills, default=None)
    if signalled and kill_after is not None:
        killed_at = signalled[0].received_at + kill_after  # wall clock
        ends.append(now + (killed_at - time.time()) - EXIT_MARGIN)
    return min(ends)


def _flush_at_exit() -> None:
    if _exit_flushed:  # a stop waited already, as long as its deadline allowed
        return
    from ..stop._termination import stops_received

    # a run that ends waits for the bucket's retention after its last upload too (else it
    # leaves a checkpoint more than ``keep`` there for good); a stop only for the upload
    stopped, mirrors = bool(stops_received()), list(_mirrors)
    if not any(m.busy or m.kept_here or (not stopped and not m.idle) for m in mirrors):
        return
    from ..stop._latch import release_for_exit

    release_for_exit()  # a signal during this wait ends the process, as the line says
    # a stop whose run then trained to its end (the grace policy) still has its deadline and
    # the supervisor's kill coming: the last upload is waited for only until then
    deadline = min([time.monotonic() + EXIT_FLUSH_SECONDS, *map(upload_deadline, stops_received())])
    for mirror in mirrors:
        mirror.flush(deadline, say=True)  # each busy one says what it waits for, and after
    if not stopped:
        for mirror in mirrors:
            if not mirror.idle:  # said: the wait is as long as the bucket's deletes take
                logger.warning(
                    "preemptible: removing the checkpoints keep=%d retires from %s before "
                    "exiting, up to %.0f s (a signal now exits at once without it)",
                    mirror.remote.keep,
                    mirror.location,
                    max(0.0, deadline - time.monotonic()),
                )
            mirror.settle(deadline)
