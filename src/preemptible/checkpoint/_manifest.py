"""A checkpoint's manifest in a bucket: what a commit writes, and what a reader accepts.

A manifest (``manifests/<name>/<generation>.json``, see ``_remote``) is a JSON object::

    {"format": 1, "name": ..., "kind": "file" | "dir", "epoch": E, "seq": N,
     "writer": "<host> <pid>", "upload": "<upload id>", "committed_at": <unix time>,
     "files": [{"path": ..., "size": ..., "sha256": ...}, ...], "dirs": [...]}

Anyone with write access to the bucket can put anything there, so a manifest is read only as
what this version writes: whole numbers as integers, a sha256 as 64 hex digits, names that
stay inside the checkpoint (no ``..``, no absolute path), no file that is also a directory.
Anything else is a ``ValueError`` from ``Remote.contents``: the reader quarantines it and
tries an older checkpoint, and nothing of it is written locally.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Any

from .._files import host_tag
from ._transfer import safe_rel

FORMAT = 1
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_WRITER_NAME = re.compile(r"[A-Za-z0-9-]{1,63} [0-9]{1,10}")  # what writer_name() writes

Files = list[tuple[str, int, str]]
"""A checkpoint's files: relative name ("" for a checkpoint that is one file), size, sha256."""


def whole(value: object) -> int | None:
    """``value`` when it is an integer (a JSON number without a fraction), else None: a
    manifest's numbers are read only as what this version writes."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def writer_name() -> str:
    """This process as ``writer.json`` and a manifest name their writer."""
    return f"{host_tag()} {os.getpid()}"


def named_writer(writer: dict[str, Any] | None) -> str:
    """The writer that ``writer`` (``writer.json``'s content) names, for a line: the host and
    pid of the run to look for when a second start with the same URL took it over. Only what
    ``writer_name`` writes is repeated (the bucket is not ours alone to write)."""
    who = (writer or {}).get("writer")
    if writer is None or not isinstance(who, str) or not _WRITER_NAME.fullmatch(who):
        return "another writer"
    host, pid = who.split(" ")
    since = writer.get("since")
    when = ""
    if isinstance(since, int | float) and not isinstance(since, bool) and 0 < since < 2**33:
        when = time.strftime(", its writer since %Y-%m-%d %H:%M:%S UTC", time.gmtime(since))
    return f"another writer (host {host}, pid {pid}{when})"


def manifest(
    name: str, kind: str, *, epoch: int, seq: int, upload: str, files: Files, dirs: list[str]
) -> dict[str, Any]:
    """The body of the manifest that commits ``name``, uploaded under ``upload``."""
    return {
        "format": FORMAT,
        "name": name,
        "kind": kind,
        "epoch": epoch,
        "seq": seq,
        "writer": writer_name(),
        "upload": upload,
        "committed_at": time.time(),
        "files": [{"path": rel, "size": size, "sha256": sha} for rel, size, sha in files],
        "dirs": dirs,
    }


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
        return whole(self.body.get("epoch")) or 0, whole(self.body.get("seq")) or 0

    def contents(self) -> tuple[str, Files, list[str]]:
        """The manifest's kind, files and directories, checked before anything is written:
        ``ValueError`` (a quarantine) for anything this version does not write, such as a name
        that escapes, a size that is not a whole number of bytes, or a file that is also a
        directory."""
        body = self.body
        bad = ValueError(f"{self.key}: not a manifest this version can read")
        upload, kind, entries = body.get("upload"), body.get("kind"), body.get("files")
        dirs = body.get("dirs", [])
        if not isinstance(upload, str) or not upload or "/" in upload or upload in (".", ".."):
            raise bad
        if kind not in ("file", "dir") or not isinstance(entries, list):
            raise bad
        if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
            raise bad
        files = []
        for entry in entries:
            if not isinstance(entry, dict):
                raise bad
            rel, size, sha = entry.get("path"), whole(entry.get("size")), entry.get("sha256")
            if not isinstance(rel, str) or size is None or size < 0:
                raise bad
            if not isinstance(sha, str) or not _SHA256.match(sha):
                raise bad
            files.append((rel, size, sha))
        if kind == "file":
            if len(files) != 1 or dirs:
                raise bad
            return kind, files, []
        for d in dirs:
            if not safe_rel(d):
                raise ValueError(f"{self.key}: a directory name escapes: {d!r}")
        names = [rel for rel, _size, _sha in files]
        for rel in names:
            if not safe_rel(rel):
                raise ValueError(f"{self.key}: a file name escapes: {rel!r}")
        parents = {rel.rsplit("/", 1)[0] for rel in names if "/" in rel}
        folders: set[str] = set()
        for folder in parents | set(dirs):
            parts = folder.split("/")
            folders.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        if len(set(names)) != len(names) or folders & set(names):
            raise bad  # a file named twice, or a file that is also a directory
        return kind, files, list(dirs)
