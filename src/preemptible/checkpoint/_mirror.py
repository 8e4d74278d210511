"""The mirror of a checkpoint URL: committed checkpoints go up to the bucket, and come back.

A URL never reaches the POSIX commit: a store for ``s3://bucket/prefix`` commits every save in
a local staging directory (``_location.staging_dir``) exactly as for any directory, and this
mirror uploads each committed checkpoint in a background thread, and at start brings the
newest one committed in the bucket back into staging when staging has nothing as new.

Layout under the prefix (object stores have no rename, so nothing is ever moved)::

    writer.json                        who writes here: {"epoch": E, "adopted": [...], ...}
    uploads/<upload-id>/<name>[/...]   a checkpoint's files, under an id used once
    manifests/<name>/<generation>.json the commit: its files, sizes, sha256, epoch, upload id
    quarantine/<name>/<generation>.json  a manifest whose files did not verify (kept, with why)

The commit protocol. The files are uploaded first under a fresh upload id; the manifest is
written last, with a create-only conditional put (``If-None-Match: *``): a checkpoint exists
in the bucket only once its manifest does. Objects without a manifest (a writer killed
mid-upload, a multipart upload never completed) are never read: a reader starts from the
manifests and reads only the keys a manifest lists, under its own upload id. A name committed
again (``resume.ckpt`` on every save) gets the next generation; two writers that commit the
same name and generation cannot both succeed, the second gets "already exists".

Fencing. A writer (a store that takes its directory's lock) first *takes over* the location:
it replaces ``writer.json`` with a conditional put on the etag it read (``If-Match``, or
create-only when there is none) that raises the epoch by one and lists, as ``adopted``, the
manifests that were committed at that moment. A manifest counts as committed when its epoch
is the current one or it is adopted; nothing else is read. So a writer replaced by a takeover
(a run resumed elsewhere while the old machine still uploads) cannot commit after it: it
checks the etag of ``writer.json`` before each manifest and stops when it changed, and a
manifest it still manages to write in the gap between that check and its put carries the old
epoch and was not adopted, so no reader ever takes it. Two takeovers at once: one wins the
conditional put, the other reads again and takes the next epoch.

Retention (``keep``) removes a checkpoint's manifest first, then its files, so a kill between
the two leaves files without a manifest, never a manifest without files. Files without a
manifest are removed at a takeover when they are older than an hour (another writer may
still be uploading them; the hour also covers clock skew). Multipart uploads left open by a
killed writer are not visible through the client: a bucket lifecycle rule that aborts
incomplete multipart uploads after a day removes them.

Verification. A download checks every file's size and sha256 against the manifest, into a
temporary name in staging that is committed only when all of it verified. One that does not
verify is quarantined in the bucket (a marker under ``quarantine/``: readers skip it, retention
never deletes it) and the next older checkpoint is tried, as the local store does with one
that does not load.

Uploads run in one background thread per mirror, one at a time: a checkpoint committed while
another is uploading waits, and a newer one replaces a waiting older one (which is then never
uploaded; the bucket keeps its previous ones). The committed checkpoint is hard-linked into
``.upload-*`` in staging first, so the local retention may remove it meanwhile. ``flush``
waits for the queue with a deadline; at exit, ``atexit`` flushes every mirror of the process.
Every request has a timeout, and 5xx and throttling answers are retried with backoff
(``_buckets``); a failed upload is logged once and the next save uploads anew.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointError, CheckpointRemoteError
from .._files import host_tag, pid_alive, remove_path
from ._buckets import first_line, open_bucket
from ._location import Location

if TYPE_CHECKING:
    from ._store import CheckpointStore

logger = logging.getLogger("preemptible")

FORMAT = 1
WRITER = "writer.json"
MANIFESTS = "manifests/"
UPLOADS = "uploads/"
QUARANTINE = "quarantine/"
STATE_NAME = ".preemptible-mirror.json"
"""In staging: for each local checkpoint, the manifest it came from or went up as."""
SNAPSHOT_PREFIX = ".upload-"

ABANDONED_AFTER = 3600.0
"""Seconds after which files without a manifest count as abandoned and may be removed."""

EXIT_FLUSH_SECONDS = 600.0
"""How long a normal interpreter exit waits for uploads still queued."""

_CHUNK = 8 * 1024 * 1024
_GEN = re.compile(r"^(\d{10})\.json$")
_FINAL = re.compile(r"^step-(\d+)\.ckpt$")


class _Fenced(CheckpointError):
    """Another writer took over the location: this one must not commit there any more."""


class _Corrupt(CheckpointError):
    """A remote checkpoint's files do not match its manifest."""


@dataclass
class Remote:
    """A checkpoint committed in the bucket (its manifest read)."""

    name: str
    generation: int
    key: str
    body: dict[str, Any]

    @property
    def order(self) -> tuple[int, int]:
        """Commit order: a later epoch (writer) first, then the writer's own count."""
        return int(self.body.get("epoch", 0)), int(self.body.get("seq", 0))


@dataclass
class _Job:
    name: str
    snapshot: Path
    queued: float = field(default_factory=time.monotonic)


_mirrors: weakref.WeakSet[Mirror] = weakref.WeakSet()
_exit_registered = False
_registry_guard = threading.Lock()


def _obstore() -> Any:
    import obstore

    return obstore


def _is(exc: BaseException, name: str) -> bool:
    return type(exc).__name__ == name


def _sha256_file(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _safe_rel(rel: str) -> bool:
    parts = rel.split("/")
    return all(p not in ("", ".", "..") for p in parts) and not rel.startswith("/")


class Mirror:
    """Uploads a staging directory's committed checkpoints to ``location``; brings the newest
    back. One per ``CheckpointStore`` of a URL."""

    def __init__(self, location: Location, staging: Path, *, keep: int) -> None:
        self.location = location
        self.staging = staging
        self.keep = keep
        self.bucket = open_bucket(location)
        self.epoch: int | None = None
        self._writer_etag: str | None = None
        self._seq = 0
        self._cond = threading.Condition()
        self._pending: _Job | None = None
        self._active: _Job | None = None
        self._thread: threading.Thread | None = None
        self._patterns: list[re.Pattern[str]] = [_FINAL]
        self.uploaded: str | None = None  # the newest name this process put in the bucket
        self.newest_remote: str | None = None  # the newest committed one seen in the bucket
        self.failed: str | None = None  # why the last upload failed, until one succeeds
        self.fenced = False
        self._check()
        _register(self)

    def __repr__(self) -> str:
        return f"Mirror({self.location})"

    # -- requests ------------------------------------------------------------------------------
    def _list(self, prefix: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for batch in _obstore().list(self.bucket, prefix=prefix, chunk_size=1000):
            found.extend(batch)
        return found

    def _get_json(self, key: str) -> tuple[dict[str, Any] | None, str | None]:
        """The JSON object at ``key`` and its etag; (None, None) when there is none."""
        obs = _obstore()
        try:
            result = obs.get(self.bucket, key)
        except FileNotFoundError:
            return None, None
        except Exception as exc:
            if _is(exc, "NotFoundError"):
                return None, None
            raise
        data = bytes(result.bytes())
        try:
            body = json.loads(data)
        except ValueError:
            body = None
        etag = result.meta.get("e_tag")
        return (body if isinstance(body, dict) else {}), etag

    def _check(self) -> None:
        """One request at start: the bucket exists and takes our credentials."""
        try:
            next(iter(_obstore().list(self.bucket, prefix=MANIFESTS, chunk_size=1)), None)
        except Exception as exc:
            raise self._refused(exc) from None

    def _refused(self, exc: BaseException) -> CheckpointRemoteError:
        text = first_line(exc)
        lower = str(exc).lower()
        if "nosuchbucket" in lower or ("does not exist" in lower and "bucket" in lower):
            why = f"bucket {self.location.bucket!r} does not exist; create it or fix the URL"
        elif (
            _is(exc, "PermissionDeniedError")
            or _is(exc, "UnauthenticatedError")
            or any(
                word in lower
                for word in ("accessdenied", "invalidaccesskeyid", "signaturedoesnotmatch", "403")
            )
        ):
            why = (
                "the credentials were refused (AWS_ACCESS_KEY_ID/AWS_PROFILE/instance role for "
                "S3, application default credentials for GCS, AZURE_STORAGE_* or managed "
                f"identity for Azure): {text}"
            )
        elif "credential" in lower or "token" in lower:
            why = f"no usable credentials from the cloud's standard chain: {text}"
        else:
            why = f"cannot be reached: {text}"
        return CheckpointRemoteError(f"checkpoint location {self.location}: {why}", None)

    # -- who writes ----------------------------------------------------------------------------
    def take_over(self) -> None:
        """Become the location's only writer (see the module docstring); also removes files
        without a manifest older than ``ABANDONED_AFTER`` and snapshots of dead uploaders."""
        obs = _obstore()
        for _ in range(8):
            current, etag = self._get_json(WRITER)
            adopted = [r.key for r in self._valid(current)]
            epoch = int((current or {}).get("epoch", 0)) + 1
            body = {
                "format": FORMAT,
                "epoch": epoch,
                "writer": f"{host_tag()} {os.getpid()}",
                "since": time.time(),
                "adopted": adopted,
            }
            mode: Any = {"e_tag": etag} if etag else "create"
            try:
                put = obs.put(self.bucket, WRITER, json.dumps(body).encode(), mode=mode)
            except Exception as exc:
                if _is(exc, "AlreadyExistsError") or _is(exc, "PreconditionError"):
                    continue  # another writer took over meanwhile: read again
                raise self._refused(exc) from None
            self.epoch, self._writer_etag, self.fenced = epoch, put.get("e_tag"), False
            break
        else:
            raise CheckpointRemoteError(
                f"checkpoint location {self.location}: could not become its writer (other "
                "writers kept taking it over)",
                None,
            )
        self._clean_snapshots()
        try:
            self._clean_abandoned()
        except Exception as exc:  # cleaning is best effort; the next takeover tries again
            logger.info("preemptible: could not clean %s: %s", self.location, first_line(exc))

    def _check_fence(self) -> None:
        if self._writer_etag is None:
            raise _Fenced(f"{self.location}: this process is not its writer", None)
        try:
            meta = _obstore().head(self.bucket, WRITER)
        except Exception as exc:
            if _is(exc, "NotFoundError"):
                meta = {}
            else:
                raise
        if meta.get("e_tag") != self._writer_etag:
            self.fenced = True
            raise _Fenced(
                f"another writer took over {self.location}: this run's checkpoints are no "
                "longer uploaded there",
                None,
            )

    # -- what is committed ---------------------------------------------------------------------
    def committed(self) -> list[Remote]:
        """The checkpoints committed in the bucket, newest first."""
        for _ in range(4):
            writer, _etag = self._get_json(WRITER)
            try:
                return self._valid(writer)
            except _Retry:
                continue  # a takeover happened while we listed: read writer.json again
        return []

    def _valid(self, writer: dict[str, Any] | None) -> list[Remote]:
        if not writer:
            return []
        epoch = int(writer.get("epoch", 0))
        adopted = set(writer.get("adopted") or [])
        quarantined = {m["path"][len(QUARANTINE) :] for m in self._list(QUARANTINE)}
        found = []
        for meta in self._list(MANIFESTS):
            key = meta["path"]
            rest = key[len(MANIFESTS) :]
            name, _, gen = rest.partition("/")
            m = _GEN.match(gen)
            if not m or "/" in gen or rest in quarantined:
                continue
            body, _ = self._get_json(key)
            if not body:
                continue
            if int(body.get("epoch", 0)) > epoch:
                raise _Retry
            if int(body.get("epoch", 0)) == epoch or key in adopted:
                found.append(Remote(name, int(m.group(1)), key, body))
        found.sort(key=lambda r: r.order, reverse=True)
        return found

    # -- bringing the newest back --------------------------------------------------------------
    def restore(self, store: CheckpointStore) -> list[Path]:
        """Bring the newest committed checkpoint of each family of names (``step-N.ckpt``,
        ``checkpoint-N``, ``resume.ckpt``: a name with its last number as the step) into
        staging, unless staging has one as new; one that does not verify is quarantined and
        the next older one of its family is tried. Returns what was brought back."""
        try:
            remotes = self.committed()
        except Exception as exc:
            raise self._refused(exc) from None
        if not remotes:
            return []
        self.newest_remote = remotes[0].name
        families: dict[str, list[Remote]] = {}
        for remote in remotes:  # newest first, so is each family's list
            families.setdefault(_family(remote.name)[0], []).append(remote)
        brought = []
        for members in families.values():
            for remote in members:
                if self._staging_as_new(remote, store):
                    break
                try:
                    path = self._download(remote, store)
                except _Corrupt as exc:
                    self._quarantine(remote, str(exc))
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
        return brought

    def _staging_as_new(self, remote: Remote, store: CheckpointStore) -> bool:
        """Whether staging holds this very checkpoint, or a newer one of its family."""
        local = self.staging / remote.name
        mark = self._read_state().get(remote.name)
        if os.path.lexists(local):
            if mark == remote.key:
                return True
            if isinstance(mark, dict) and "local" in mark:  # committed here, maybe not uploaded
                return float(mark["local"]) >= float(remote.body.get("committed_at", 0))
        _key, pattern = _family(remote.name)
        if pattern is None:
            return False
        m = pattern.match(remote.name)
        assert m is not None
        step = int(m.group(1))
        return any(c.step >= step for c in store.committed(pattern))

    def _download(self, remote: Remote, store: CheckpointStore) -> Path:
        body = remote.body
        upload = str(body.get("upload", ""))
        base = f"{UPLOADS}{upload}/{remote.name}"
        files = body.get("files")
        if not upload or "/" in upload or not isinstance(files, list):
            raise _Corrupt(f"{remote.key}: not a manifest this version can read", None)
        kind = body.get("kind")

        def write(tmp: Path) -> None:
            if kind == "dir":
                tmp.mkdir()
                for d in body.get("dirs", []):
                    if not _safe_rel(d):
                        raise _Corrupt(f"{remote.key}: a directory name escapes: {d!r}", None)
                    (tmp / d).mkdir(parents=True, exist_ok=True)
            for entry in files:
                rel = str(entry.get("path", ""))
                if kind == "dir" and not _safe_rel(rel):
                    raise _Corrupt(f"{remote.key}: a file name escapes: {rel!r}", None)
                key = f"{base}/{rel}" if kind == "dir" else base
                target = tmp / rel if kind == "dir" else tmp
                target.parent.mkdir(parents=True, exist_ok=True)
                self._get_file(remote, key, target, int(entry["size"]), str(entry["sha256"]))

        try:
            return store.commit_local(remote.name, write)
        except Exception as exc:
            cause = exc.__cause__
            if isinstance(cause, _Corrupt):
                raise cause from None
            if isinstance(cause, Exception) and _is(cause, "NotFoundError"):
                raise _Corrupt(f"{remote.key}: a file it lists is missing", None) from None
            raise

    def _get_file(self, remote: Remote, key: str, target: Path, size: int, sha: str) -> None:
        result = _obstore().get(self.bucket, key)
        digest = hashlib.sha256()
        got = 0
        with open(target, "wb") as f:
            for chunk in result.stream(min_chunk_size=_CHUNK):
                data = memoryview(chunk)
                digest.update(data)
                got += len(data)
                f.write(data)
        if got != size:
            raise _Corrupt(f"{key}: {got} bytes, the manifest says {size}", None)
        if digest.hexdigest() != sha:
            raise _Corrupt(f"{key}: its sha256 differs from the manifest's", None)

    def _quarantine(self, remote: Remote, reason: str) -> None:
        key = f"{QUARANTINE}{remote.name}/{remote.generation:010d}.json"
        body = {"manifest": remote.key, "reason": reason, "at": time.time()}
        try:
            _obstore().put(self.bucket, key, json.dumps(body).encode(), mode="create")
        except Exception as exc:
            if not _is(exc, "AlreadyExistsError"):
                logger.warning(
                    "preemptible: could not quarantine %s in %s: %s",
                    remote.key,
                    self.location,
                    first_line(exc),
                )
        logger.warning(
            "preemptible: skipping %s in %s: %s; quarantined (kept in the bucket, marked %s)",
            remote.name,
            self.location,
            reason,
            self.location.key(key),
        )

    # -- state of staging ----------------------------------------------------------------------
    def _read_state(self) -> dict[str, Any]:
        try:
            data = json.loads((self.staging / STATE_NAME).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write_state(self, state: dict[str, Any]) -> None:
        path = self.staging / STATE_NAME
        tmp = path.with_name(f"{STATE_NAME}.{os.getpid()}.{os.urandom(4).hex()}")
        try:
            tmp.write_text(json.dumps(state))
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _mark(self, name: str, value: Any) -> None:
        with self._cond:  # one writer of the state file in this process
            state = self._read_state()
            state[name] = value
            live = {p.name for p in self.staging.iterdir()} if self.staging.is_dir() else set()
            self._write_state({k: v for k, v in state.items() if k in live})

    # -- uploading -----------------------------------------------------------------------------
    def enqueue(self, name: str, path: Path) -> None:
        """Upload the checkpoint just committed at ``path`` (in the background)."""
        self._mark(name, {"local": time.time()})
        if self.fenced:
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

    def _clean_snapshots(self) -> None:
        me = host_tag()
        for entry in self.staging.glob(f"{SNAPSHOT_PREFIX}*"):
            parts = entry.name[len(SNAPSHOT_PREFIX) :].split(".")
            mine = len(parts) == 3 and parts[0] == me and parts[1].isdecimal()
            if mine and not pid_alive(int(parts[1])):
                remove_path(entry)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                job, self._pending = self._pending, None
                self._active = job
            try:
                self._upload(job)
            except _Fenced as exc:
                self.failed = str(exc)
                logger.error("preemptible: %s (%s was not committed there)", exc, job.name)
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
            else:
                self.failed = None
            finally:
                remove_path(job.snapshot.parent)
                with self._cond:
                    self._active = None
                    self._cond.notify_all()

    def _upload(self, job: _Job) -> None:
        obs = _obstore()
        if self.fenced:
            raise _Fenced(f"another writer took over {self.location}", None)
        if self.epoch is None:
            self.take_over()
        self._check_fence()
        upload = f"{self.epoch}-{os.urandom(8).hex()}"
        base = f"{UPLOADS}{upload}/{job.name}"
        files: list[dict[str, Any]] = []
        dirs: list[str] = []
        if job.snapshot.is_dir():
            kind = "dir"
            for rel, path in _walk(job.snapshot, dirs):
                size, sha = _sha256_file(path)
                obs.put(self.bucket, f"{base}/{rel}", path)
                files.append({"path": rel, "size": size, "sha256": sha})
        else:
            kind = "file"
            size, sha = _sha256_file(job.snapshot)
            obs.put(self.bucket, base, job.snapshot)
            files.append({"path": "", "size": size, "sha256": sha})
        self._seq += 1
        body = {
            "format": FORMAT,
            "name": job.name,
            "kind": kind,
            "epoch": self.epoch,
            "seq": self._seq,
            "writer": f"{host_tag()} {os.getpid()}",
            "upload": upload,
            "committed_at": time.time(),
            "files": files,
            "dirs": dirs,
        }
        key = self._commit_manifest(job.name, body)
        self.uploaded = self.newest_remote = job.name
        self._mark(job.name, key)
        logger.info("preemptible: uploaded %s to %s", job.name, self.location)
        from .. import _run

        _run.update_record(remote_checkpoint=f"{self.location}/{job.name}")
        self._retire_after(job.name)

    def _commit_manifest(self, name: str, body: dict[str, Any]) -> str:
        obs = _obstore()
        existing = [
            int(m.group(1))
            for meta in self._list(f"{MANIFESTS}{name}/")
            if (m := _GEN.match(meta["path"].rsplit("/", 1)[-1]))
        ]
        generation = max(existing, default=0) + 1
        for _ in range(4):
            key = f"{MANIFESTS}{name}/{generation:010d}.json"
            self._check_fence()  # the last moment a takeover can be seen before the commit
            try:
                obs.put(self.bucket, key, json.dumps(body).encode(), mode="create")
                return key
            except Exception as exc:
                if not _is(exc, "AlreadyExistsError"):
                    raise
            other, _ = self._get_json(key)
            if other and int(other.get("epoch", 0)) >= int(body["epoch"]):
                raise CheckpointError(
                    f"{self.location}: another writer committed {name} generation {generation} "
                    "first",
                    None,
                )
            generation += 1  # a fenced writer's late manifest holds that name: never read
        raise CheckpointError(f"{self.location}: could not commit {name}", None)

    # -- retention and cleaning ----------------------------------------------------------------
    def _retire_after(self, name: str) -> None:
        remotes = self.committed()
        newest: dict[str, Remote] = {}
        for remote in remotes:  # newest first: older generations of a name are superseded
            if remote.name in newest:
                self._retire(remote)
            else:
                newest[remote.name] = remote
        for pattern in self._patterns:
            m = pattern.match(name)
            if not m:
                continue
            upto = int(m.group(1))
            steps = sorted(
                (
                    (int(mm.group(1)), r)
                    for r in newest.values()
                    if (mm := pattern.match(r.name)) and int(mm.group(1)) <= upto
                ),
                key=lambda pair: pair[0],
                reverse=True,
            )
            for _step, remote in steps[self.keep :]:
                self._retire(remote)

    def _retire(self, remote: Remote) -> None:
        """Remove a committed checkpoint: the manifest first, then its files."""
        obs = _obstore()
        obs.delete(self.bucket, remote.key)
        upload = str(remote.body.get("upload", ""))
        if not upload or "/" in upload:
            return
        keys = [m["path"] for m in self._list(f"{UPLOADS}{upload}/")]
        if keys:
            obs.delete(self.bucket, keys)

    def _clean_abandoned(self) -> None:
        referenced = set()
        for meta in self._list(MANIFESTS):
            body, _ = self._get_json(meta["path"])
            if body and isinstance(body.get("upload"), str):
                referenced.add(body["upload"])
        groups: dict[str, list[dict[str, Any]]] = {}
        for meta in self._list(UPLOADS):
            upload = meta["path"][len(UPLOADS) :].split("/", 1)[0]
            groups.setdefault(upload, []).append(meta)
        now = time.time()
        for upload, metas in groups.items():
            if upload in referenced:
                continue
            newest = max(m["last_modified"].timestamp() for m in metas)
            if now - newest > ABANDONED_AFTER:
                _obstore().delete(self.bucket, [m["path"] for m in metas])
                logger.info(
                    "preemptible: removed an upload that was never committed from %s (%d files)",
                    self.location,
                    len(metas),
                )

    # -- waiting -------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._pending is not None or self._active is not None

    def newest_in_bucket(self) -> str:
        return self.newest_remote or "none"

    def flush(self, deadline: float | None = None) -> bool:
        """Wait until every queued upload is done (``deadline``: ``time.monotonic()`` value).
        False, with one line naming the newest checkpoint in the bucket, when the deadline
        passed first or the last upload failed."""
        with self._cond:
            while self._pending is not None or self._active is not None:
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
                self._cond.wait(left)
        return self.failed is None


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


def _walk(root: Path, dirs: list[str]) -> Iterator[tuple[str, Path]]:
    for here, subdirs, names in os.walk(root):
        subdirs.sort()
        rel_here = os.path.relpath(here, root)
        for d in subdirs:
            dirs.append(d if rel_here == "." else f"{rel_here}/{d}")
        for name in sorted(names):
            rel = name if rel_here == "." else f"{rel_here}/{name}"
            yield rel.replace(os.sep, "/"), Path(here) / name


class _Retry(Exception):
    pass


def _register(mirror: Mirror) -> None:
    global _exit_registered
    with _registry_guard:
        _mirrors.add(mirror)
        if not _exit_registered:
            _exit_registered = True
            atexit.register(_flush_at_exit)


_exit_deadline: float | None = None  # a stop's: the exit's flush waits no longer


def flush_all(deadline: float | None = None) -> bool:
    """Flush every mirror of this process (see ``Mirror.flush``); True when all are done.
    A deadline (a stop's) also bounds the flush at the interpreter's exit that follows: the
    process is gone by then whatever the network does."""
    global _exit_deadline
    if deadline is not None:
        _exit_deadline = deadline if _exit_deadline is None else min(_exit_deadline, deadline)
    ok = True
    for mirror in list(_mirrors):
        ok = mirror.flush(deadline) and ok
    return ok


def _flush_at_exit() -> None:
    busy = [m for m in list(_mirrors) if m.busy]
    if not busy:
        return
    if _exit_deadline is not None and _exit_deadline <= time.monotonic():
        return  # a stop flushed until its deadline and said what did not make it: exit now
    if _exit_deadline is not None:
        flush_all(_exit_deadline)
        return
    logger.warning(
        "preemptible: waiting up to %d s for the upload to %s before exiting",
        EXIT_FLUSH_SECONDS,
        ", ".join(str(m.location) for m in busy),
    )
    flush_all(time.monotonic() + EXIT_FLUSH_SECONDS)
