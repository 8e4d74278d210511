"""The commit protocol of checkpoints in a bucket (S3, GCS, Azure Blob), through obstore.

Object stores have no rename, so nothing here is ever moved. Layout under the prefix::

    writer.json                          who writes here: {"epoch": E, "adopted": [...], ...}
    uploads/<upload-id>/<name>[/...]     a checkpoint's files, under an id used once
    manifests/<name>/<generation>.json   the commit: files, sizes, sha256, epoch, upload id
                                         (what one holds, and is checked for: ``_manifest``)
    quarantine/<name>/<generation>.json  a manifest whose files did not verify (kept, with why)

The commit. The files are uploaded first under a fresh upload id; the manifest is written
last, with a create-only conditional put (``If-None-Match: *``): a checkpoint exists in the
bucket only once its manifest does. Files without a manifest (a writer killed mid-upload) are
never read: a reader starts from the manifests and reads only the keys a manifest lists, under
its own upload id, with no ``..`` in them. A name committed again (``resume.ckpt`` on every
save) gets the next generation; two writers that commit the same name and generation cannot
both succeed: the second gets "already exists" and does not replace the first.

Fencing. A writer (a store that takes its directory's lock) first *takes over* the location:
it replaces ``writer.json`` with a conditional put on the etag it read (``If-Match``, or
create-only when there is none) that raises the epoch by one and lists, as ``adopted``, the
manifests committed at that moment. A manifest counts as committed when its epoch is the
current one or it is adopted; nothing else is read. So a writer replaced by a takeover (a run
resumed elsewhere while the old machine still uploads) cannot commit after it: it checks the
etag of ``writer.json`` right before each manifest and stops when it changed, and a manifest it
still writes in the gap between that check and its put carries the old epoch and was not
adopted, so no reader ever takes it. Of two takeovers at once, one wins the conditional put;
the other reads again and takes the next epoch.

Retention removes a checkpoint's manifest first, then its files, so a kill between the two
leaves files without a manifest, never a manifest without files. Files without a manifest are
removed at a takeover once they are an hour old (another writer may still be uploading them;
the hour also covers clock skew). Multipart uploads left open by a killed writer are not
listed through the client: a bucket lifecycle rule that aborts incomplete multipart uploads
(after a day) removes them.

Verification. A download checks every file's size and sha256 against the manifest. One that
does not verify is quarantined: a marker under ``quarantine/`` that readers skip and retention
never deletes; the manifest and the files stay as they were.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .._errors import CheckpointError, CheckpointRemoteError, PreemptibleError
from ._buckets import first_line, open_bucket, refused
from ._location import Location
from ._manifest import (
    FORMAT,
    Files,
    Remote,
    manifest,
    named_writer,
    whole,
    writer_name,
)
from ._transfer import progress, safe_rel, sha256_file, walk_files

logger = logging.getLogger("preemptible")

WRITER = "writer.json"
MANIFESTS = "manifests/"
UPLOADS = "uploads/"
QUARANTINE = "quarantine/"

ABANDONED_AFTER = 3600.0
"""Seconds after which files without a manifest count as abandoned and may be removed."""

_PARALLEL_FILES = 4  # files of a checkpoint downloaded at once (as an upload sends parts)
_RANGE = 128 * 1024 * 1024  # bytes per GET of a download: >= 2.2 MB/s within the timeout

_GEN = re.compile(r"^(\d{10})\.json$")
# the client's line for a ranged GET past an object's end; only the status, never a bare
# "416" (an upload id in the key is random hex: "1-a5b46416a1d7e187")
_RANGE_NOT_SATISFIABLE = re.compile(r"status code: 416\b")

MANIFEST_MAX = 64 * 1024 * 1024
"""Bytes past which a manifest (or writer.json) is not read: one of a checkpoint with 400 000
files fits; a larger object there is not ours, and reading it whole could exhaust memory."""


class _Corrupt(CheckpointError):
    """A remote checkpoint's files do not match its manifest, or it is not one we write."""


class _Fenced(CheckpointError):
    """Another writer took over the location: this one must not commit there any more."""


def _obstore() -> Any:
    import obstore

    return obstore


def _is(exc: BaseException, name: str) -> bool:
    """Whether obstore raised its error ``name`` (a missing object is a FileNotFoundError)."""
    if name == "NotFoundError" and isinstance(exc, FileNotFoundError):
        return True
    return type(exc).__name__ == name


class _Retry(Exception):
    """A takeover happened while the manifests were listed: read ``writer.json`` again."""


class RemoteCheckpoints:
    """The checkpoints committed under a URL: read, commit, retire, quarantine. Raises
    ``CheckpointRemoteError`` at construction when the bucket cannot be used."""

    def __init__(self, location: Location, *, keep: int) -> None:
        self.location = location
        self.keep = keep
        self.bucket = open_bucket(location)
        self.epoch: int | None = None  # this writer's, once it took the location over
        self.fenced = False  # another writer took over since
        self.fenced_said = False
        self._writer_etag: str | None = None
        self._writer_body: dict[str, Any] | None = None  # what this writer put in writer.json
        self._bodies: dict[str, dict[str, Any]] = {}  # manifests read (a key is written once)
        self._seq = 0
        self._check()

    def __repr__(self) -> str:
        return f"RemoteCheckpoints({self.location})"

    # -- requests ------------------------------------------------------------------------------
    def _list(self, prefix: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for batch in _obstore().list(self.bucket, prefix=prefix, chunk_size=1000):
            found.extend(batch)
        return found

    def _get_json(self, key: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The JSON object at ``key`` and its version (etag, and the generation on GCS: what
        a conditional update names); (None, None) when there is none."""
        obs = _obstore()
        try:
            result = obs.get(self.bucket, key)
        except FileNotFoundError:
            return None, None
        except Exception as exc:
            if _is(exc, "NotFoundError"):
                return None, None
            raise
        if int(result.meta.get("size") or 0) > MANIFEST_MAX:
            logger.warning(
                "preemptible: ignoring %s in %s: %d bytes, more than a manifest holds",
                key,
                self.location,
                int(result.meta["size"]),
            )
            return {}, None
        data = bytes(result.bytes())
        try:
            body = json.loads(data)
        except (ValueError, RecursionError):  # not JSON, or nested too deep to parse
            body = None
        version = {k: v for k in ("e_tag", "version") if (v := result.meta.get(k)) is not None}
        return (body if isinstance(body, dict) else {}), version

    def _body(self, key: str) -> dict[str, Any] | None:
        """A manifest's content, read once (a key is written once, create-only)."""
        body = self._bodies.get(key)
        if body is None:
            body, _ = self._get_json(key)
            if body:
                self._bodies[key] = body
        return body

    def _check(self) -> None:
        """One request at start: the bucket exists and takes our credentials."""
        try:
            next(iter(_obstore().list(self.bucket, prefix=MANIFESTS, chunk_size=1)), None)
        except Exception as exc:
            raise self.refused(exc) from None

    def refused(self, exc: BaseException) -> CheckpointRemoteError:
        return refused(self.location, exc)

    # -- who writes ----------------------------------------------------------------------------
    def take_over(self) -> None:
        """Become the location's only writer (see the module docstring); also removes files
        without a manifest older than ``ABANDONED_AFTER``. A bucket that stopped answering
        since the start is one line (``CheckpointRemoteError``), not the client's dump of the
        request, which quotes the endpoint as given (a password in it too)."""
        try:
            self._take_over()
        except PreemptibleError:
            raise
        except Exception as exc:
            raise self.refused(exc) from None

    def _take_over(self) -> None:
        obs = _obstore()
        for attempt in range(8):
            current, version = self._get_json(WRITER)
            try:
                adopted = [r.key for r in self._valid(current, settled=attempt == 7)]
            except _Retry:
                continue  # another writer took over while we listed: read writer.json again
            epoch = self._writer_view(current)[0] + 1
            body = {
                "format": FORMAT,
                "epoch": epoch,
                "writer": writer_name(),
                "since": time.time(),
                "adopted": adopted,
            }
            mode: Any = version if version else "create"  # If-Match, or If-None-Match: *
            try:
                put = obs.put(self.bucket, WRITER, json.dumps(body).encode(), mode=mode)
            except Exception as exc:
                if _is(exc, "AlreadyExistsError") or _is(exc, "PreconditionError"):
                    continue  # another writer took over meanwhile: read again
                raise self.refused(exc) from None
            self.epoch, self._writer_etag, self.fenced = epoch, put.get("e_tag"), False
            self._writer_body = body
            break
        else:
            raise CheckpointRemoteError(
                f"checkpoint location {self.location}: could not become its writer (other "
                "writers kept taking it over)",
                None,
            )
        try:
            self._clean_abandoned()
        except Exception as exc:  # cleaning is best effort; the next takeover tries again
            logger.info("preemptible: could not clean %s: %s", self.location, first_line(exc))

    def _writer_view(self, writer: dict[str, Any] | None) -> tuple[int, set[str]]:
        """writer.json's epoch and adopted manifests; (0, empty) when there is none (a fresh
        location). One this version does not write (not JSON, another format, an epoch that
        is not a whole number) fails closed: taken for none, the run would start from zero
        and its takeover would leave every checkpoint there unread from then on."""
        if writer is None:
            return 0, set()
        epoch, adopted = whole(writer.get("epoch")), writer.get("adopted")
        if (
            writer.get("format") != FORMAT
            or epoch is None
            or epoch < 1
            or not isinstance(adopted, list)
            or not all(isinstance(key, str) for key in adopted)
        ):
            raise CheckpointRemoteError(
                f"checkpoint location {self.location}: {self.location.key(WRITER)} is not one "
                f"this version of preemptible writes (format {FORMAT}), so which checkpoints "
                "there are committed is not known; nothing was changed. Put back the "
                "writer.json preemptible wrote, or give this run a prefix of its own",
                None,
            )
        return epoch, set(adopted)

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
                f"{self._successor()} took over {self.location}: this run's checkpoints are "
                "no longer uploaded there (one location, one run: when that run is a mistake, "
                "stop it and start this one again)",
                None,
            )

    def _successor(self) -> str:
        """Who took the location over, as ``writer.json`` names them (``named_writer``)."""
        try:
            return named_writer(self._get_json(WRITER)[0])
        except Exception:  # the line says what it can
            return named_writer(None)

    def committed(self) -> list[Remote]:
        """The checkpoints committed in the bucket, newest first."""
        for attempt in range(4):
            writer, _version = self._get_json(WRITER)
            try:
                return self._valid(writer, settled=attempt == 3)
            except _Retry:
                continue  # a takeover happened while we listed: read writer.json again
        return []

    def _valid(self, writer: dict[str, Any] | None, *, settled: bool = False) -> list[Remote]:
        """The manifests that count under ``writer`` (writer.json's content). A manifest of a
        later epoch means a takeover while we listed (``_Retry``); ``settled``: after the
        retries, such a manifest is one writer.json does not vouch for, skipped like any
        other (not taken for a reason to see no checkpoint at all)."""
        epoch, adopted = self._writer_view(writer)
        if not epoch:
            return []
        quarantined = {m["path"][len(QUARANTINE) :] for m in self._list(QUARANTINE)}
        found = []
        for meta in self._list(MANIFESTS):
            key = meta["path"]
            rest = key[len(MANIFESTS) :]
            name, _, gen = rest.partition("/")
            m = _GEN.match(gen)
            if not m or "/" in gen or rest in quarantined or name.startswith("."):
                continue  # a name of ours is a plain file name: never .preemptible.lock
            if not safe_rel(name):
                continue  # nor one no local file system holds (staging could not commit it)
            body = self._body(key)
            written = whole(body.get("epoch")) if body else None
            if body is None or written is None:
                continue  # not a manifest this version writes: never taken for a checkpoint
            if written > epoch and not settled:
                raise _Retry
            if written == epoch or key in adopted:
                found.append(Remote(name, int(m.group(1)), key, body))
        found.sort(key=lambda r: r.order, reverse=True)
        return found

    # -- bringing back ---------------------------------------------------------------------------
    def bring_back(
        self, remote: Remote, commit: Callable[[str, Callable[[Path], None]], Path]
    ) -> Path | None:
        """Download ``remote`` through ``commit(name, write)`` (staging's POSIX commit); None
        when it does not verify: it is then quarantined, and nothing is committed."""
        try:
            try:
                return commit(remote.name, lambda tmp: self.download(remote, tmp))
            except CheckpointError as exc:  # the commit wraps what the download raised
                if isinstance(exc.__cause__, _Corrupt):
                    raise exc.__cause__ from None
                if exc.__cause__ is not None and "obstore" in type(exc.__cause__).__module__:
                    raise self.refused(exc.__cause__) from None  # the bucket, not the file
                raise
        except _Corrupt as exc:
            self.quarantine(remote, str(exc))
            return None

    def download(self, remote: Remote, tmp: Path) -> None:
        """Write ``remote``'s files at ``tmp`` (a file, or a directory tree), each checked
        against the manifest's size and sha256 (``_Corrupt`` when one differs or is missing)."""
        body = remote.body
        try:
            kind, files, dirs = remote.contents()
        except ValueError as odd:  # not a manifest this version writes
            raise _Corrupt(str(odd), None) from None
        base = f"{UPLOADS}{body['upload']}/{remote.name}"
        if kind == "dir":
            tmp.mkdir()
            for d in dirs:
                (tmp / d).mkdir(parents=True, exist_ok=True)
        jobs = []
        for rel, size, sha in files:
            target = tmp / rel if kind == "dir" else tmp
            target.parent.mkdir(parents=True, exist_ok=True)
            key = f"{base}/{rel}" if kind == "dir" else base
            jobs.append((key, target, size, sha))
        total = sum(job[2] for job in jobs)
        with progress(total, f"{remote.name} from {self.location}") as advance:
            with ThreadPoolExecutor(_PARALLEL_FILES, thread_name_prefix="preemptible-get") as pool:
                done = [pool.submit(self._get_file, *job, advance) for job in jobs]
            for job, future in zip(jobs, done, strict=True):
                exc = future.exception()
                if exc is not None and _is(exc, "NotFoundError"):
                    raise _Corrupt(f"{job[0]}: missing from the bucket", None)
                if exc is not None:
                    raise exc

    def _get_file(
        self, key: str, target: Path, size: int, sha: str, advance: Callable[[int], None]
    ) -> None:
        """One file, in ranges of ``_RANGE`` bytes: each request is bounded by the client's
        timeout whatever the checkpoint's size (a single GET of many GB would not be)."""
        obs = _obstore()
        digest = hashlib.sha256()
        with open(target, "wb") as f:
            done = 0
            while done < size:
                end = min(done + _RANGE, size)
                try:
                    result = obs.get(self.bucket, key, options={"range": (done, end)})
                except Exception as exc:  # 416: it ends before the manifest's size
                    if not _RANGE_NOT_SATISFIABLE.search(first_line(exc)):
                        raise  # a missing object among them (its key may hold "416")
                    raise _Corrupt(f"{key}: shorter than the manifest says", None) from None
                stored = int(result.meta["size"])  # the whole object's size
                if stored != size:
                    raise _Corrupt(f"{key}: {stored} bytes, the manifest says {size}", None)
                data = memoryview(result.bytes())
                if not len(data):
                    raise _Corrupt(f"{key}: ended after {done} bytes of {size}", None)
                digest.update(data)
                f.write(data)
                done += len(data)
                advance(len(data))
        if digest.hexdigest() != sha:
            raise _Corrupt(f"{key}: its sha256 differs from the manifest's", None)

    def quarantine(self, remote: Remote, reason: str) -> None:
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

    # -- committing ------------------------------------------------------------------------------
    def upload(self, name: str, local: Path) -> str | None:
        """Commit the checkpoint at ``local`` (a file or a directory) as ``name``: its files
        under a fresh upload id, then its manifest, create-only. Returns the manifest's key;
        None when another writer took the location over (``fenced``, logged once)."""
        try:
            return self._upload(name, local)
        except _Fenced as exc:
            if not self.fenced_said:
                self.fenced_said = True
                logger.error("preemptible: %s (%s was not committed there)", exc, name)
            self.fenced = True
            return None

    def _upload(self, name: str, local: Path) -> str:
        if self.fenced:
            raise _Fenced(f"another writer took over {self.location}", None)
        if self.epoch is None:
            self.take_over()
        assert self.epoch is not None  # or take_over raised
        upload = f"{self.epoch}-{os.urandom(8).hex()}"
        base = f"{UPLOADS}{upload}/{name}"
        files: Files = []
        dirs: list[str] = []
        if local.is_dir():
            kind = "dir"
            for rel, path in walk_files(local, dirs):
                files.append((rel, *self._put_file(f"{base}/{rel}", path)))
        else:
            kind = "file"
            files.append(("", *self._put_file(base, local)))
        self._seq += 1
        body = manifest(
            name, kind, epoch=self.epoch, seq=self._seq, upload=upload, files=files, dirs=dirs
        )
        return self._commit_manifest(name, body)

    def _put_file(self, key: str, path: Path) -> tuple[int, str]:
        """Upload one file and return its size and sha256, computed in a second thread while
        obstore sends it (both release the GIL; the file is committed, nobody writes it). A
        plain daemon thread, not a pool: the last upload of a run that ends runs in the atexit
        flush, when Python's thread pools take no new work, and a pool's thread would also be
        joined at exit, past a notice's deadline."""
        hashed: list[tuple[int, str] | BaseException] = []

        def hashing() -> None:
            try:
                hashed.append(sha256_file(path))
            except BaseException as exc:  # raised again below, in the uploader's thread
                hashed.append(exc)

        hasher = threading.Thread(target=hashing, name="preemptible-sha256", daemon=True)
        hasher.start()
        try:
            _obstore().put(self.bucket, key, path)
        finally:
            hasher.join()
        if isinstance(hashed[0], BaseException):
            raise hashed[0]
        return hashed[0]

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
            if other and (whole(other.get("epoch")) or 0) >= int(body["epoch"]):
                raise CheckpointError(
                    f"{self.location}: another writer committed {name} generation {generation} "
                    "first",
                    None,
                )
            generation += 1  # a fenced writer's late manifest holds that name: never read
        raise CheckpointError(f"{self.location}: could not commit {name}", None)

    # -- retention and cleaning ----------------------------------------------------------------
    def retire_after(self, name: str, patterns: list[re.Pattern[str]]) -> None:
        """Retention after ``name`` was committed: older generations of every name, and for
        each pattern ``name`` matches, all but the newest ``keep`` at or below its step."""
        remotes = self._valid(self._writer_body)  # this writer's view: it just checked the fence
        newest: dict[str, Remote] = {}
        for remote in remotes:  # newest first: older generations of a name are superseded
            if remote.name in newest:
                self._retire(remote)
            else:
                newest[remote.name] = remote
        for pattern in patterns:
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
        self._bodies.pop(remote.key, None)
        base = f"{UPLOADS}{upload}/{remote.name}"
        files = remote.body.get("files") or []
        if remote.body.get("kind") == "dir" and isinstance(files, list):
            keys = [
                f"{base}/{f['path']}"
                for f in files
                if isinstance(f, dict) and isinstance(f.get("path"), str) and safe_rel(f["path"])
            ]
        else:
            keys = [base]
        if keys:
            obs.delete(self.bucket, keys)

    def _clean_abandoned(self) -> None:
        referenced = set()
        for meta in self._list(MANIFESTS):
            body = self._body(meta["path"])
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
