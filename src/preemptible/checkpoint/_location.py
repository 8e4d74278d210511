"""Where checkpoints live: a local directory or an object-store URL, parsed once.

A checkpoint location given as a string is a URL when it starts with ``scheme://``; anything
else is a local path, as it always was. A URL is checked here, before anything touches the
network or the disk, so that a typo is one line at start (``ConfigError``) instead of a
directory named ``s3:`` in the working directory (``Path("s3://b/p")`` collapses the ``//``,
which is how a URL used to be taken for a relative directory).

Valid: ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix`` (also
``azure://``) and ``file:///absolute/path`` (a plain local directory). The prefix may be empty;
it never contains ``..`` or ``.`` parts, a query string or a fragment, and the URL carries no
credentials: those come from each cloud's standard chain (environment, profile, instance role).

A URL's checkpoints are committed first in a local *staging* directory (the POSIX commit, as
for any directory) and mirrored to the bucket: ``staging_dir`` names that directory after the
URL, readable and short, with a hash so that two URLs never share one.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from .._env import env_str
from .._errors import ConfigError

_SCHEMES = {"s3": "s3", "gs": "gs", "az": "az", "azure": "az", "file": "file"}
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# a scheme of ours without its "//" (s3:/bucket/p, s3:bucket): a typo, never meant as a relative
# directory named "s3:" (which is what Path makes of it, the run then starting from zero)
_NEAR_URL = re.compile(r"^(s3|gs|az|azure|file):(?!//)", re.IGNORECASE)
# each cloud's own naming rule, checked here rather than met as a 400 (or a request to a
# different host) at the first request; the message states the rule of the scheme in use
_NAMES = {
    # S3 (general purpose buckets): 3 to 63, no underscores, no upper case
    "s3": (
        re.compile(r"^(?=.{3,63}$)[a-z0-9][a-z0-9.-]*[a-z0-9]$"),
        "an S3 bucket name is 3 to 63 lower-case letters, digits, dots and hyphens, starting "
        "and ending with a letter or digit",
    ),
    # GCS: up to 222 with dots, each dot-separated part at most 63 (checked below)
    "gs": (
        re.compile(r"^(?=.{3,222}$)[a-z0-9][a-z0-9._-]*[a-z0-9]$"),
        "a GCS bucket name is 3 to 63 lower-case letters, digits, hyphens, underscores and "
        "dots (up to 222 with dots, each dot-separated part at most 63), starting and ending "
        "with a letter or digit",
    ),
    "az": (
        re.compile(r"^(?=.{3,63}$)[a-z0-9]+(-[a-z0-9]+)*$"),
        "an Azure container name is 3 to 63 lower-case letters, digits and hyphens, starting "
        "and ending with a letter or digit, no two hyphens in a row",
    ),
}


def _bucket_ok(scheme: str, bucket: str) -> bool:
    pattern, _ = _NAMES[scheme]
    if not pattern.match(bucket):
        return False
    if scheme == "gs":
        parts = bucket.split(".")
        return (len(bucket) <= 63 or len(parts) > 1) and all(len(p) <= 63 for p in parts)
    return True


_VALID = (
    "use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, az://CONTAINER/PREFIX or file:///ABSOLUTE/PATH"
)


def is_url(value: object) -> bool:
    """Whether ``value`` is a location string written as a URL (``scheme://...``)."""
    return isinstance(value, str | Location) and (
        isinstance(value, Location) or bool(_URL.match(value) or _NEAR_URL.match(value))
    )


@dataclass(frozen=True)
class Location:
    """A parsed checkpoint location. ``scheme`` is ``s3``, ``gs``, ``az`` or ``file``;
    ``bucket`` the bucket or container (empty for ``file``); ``prefix`` the path inside it
    without leading or trailing slash (for ``file``: the absolute local path)."""

    scheme: str
    bucket: str
    prefix: str
    # the local staging directory when the caller names it (the Hugging Face Trainer's
    # output_dir, where its checkpoints must be); not part of the location itself
    staging: str = field(default="", compare=False)

    @classmethod
    def parse(cls, value: str | os.PathLike[str] | Location) -> Location:
        if isinstance(value, Location):
            return value
        from urllib.parse import unquote, urlsplit  # a URL given: not at every import

        text = os.fspath(value)
        near = _NEAR_URL.match(text)
        if near:
            raise ConfigError(
                f"checkpoint location {near.group(0)}...: a URL needs '//' after its scheme; "
                f"{_VALID}"
            )
        if not _URL.match(text):
            raise ConfigError(f"checkpoint location {text!r} is not a URL; {_VALID}")
        scheme_given = text.split("://", 1)[0]
        scheme = _SCHEMES.get(scheme_given.lower())
        if scheme is None:
            raise ConfigError(
                f"checkpoint location {scheme_given}://...: unknown scheme {scheme_given!r}; "
                f"{_VALID}"
            )
        parts = urlsplit(text)
        # as typed (hostname would be lower-cased), never the secrets before an "@"
        shown = f"{scheme_given}://{parts.netloc.rpartition('@')[2]}{parts.path}"
        if parts.query or parts.fragment or text.endswith(("?", "#")):
            raise ConfigError(
                f"checkpoint location {shown}: a query string or fragment is not valid; {_VALID}"
            )
        if "@" in parts.netloc:
            raise ConfigError(
                f"checkpoint location {shown}: credentials in the URL are not valid; give them "
                "the cloud's usual way (environment variables, profile, instance role)"
            )
        if scheme == "file":
            if parts.netloc not in ("", "localhost"):
                raise ConfigError(
                    f"checkpoint location {text}: file:// URLs name a local path "
                    "(file:///absolute/path), not a host"
                )
            path = unquote(parts.path)
            if not path.startswith("/"):
                raise ConfigError(f"checkpoint location {text}: {_VALID}")
            return cls("file", "", os.path.normpath(path))
        bucket = parts.netloc
        if not bucket:
            raise ConfigError(f"checkpoint location {shown}: no bucket or container; {_VALID}")
        if not _bucket_ok(scheme, bucket):
            raise ConfigError(
                f"checkpoint location {shown}: {bucket!r} is not a valid name: {_NAMES[scheme][1]}"
            )
        decoded = unquote(parts.path)
        if any(ord(c) < 32 or c == "\x7f" for c in text + decoded):  # %0A as much as a newline
            raise ConfigError(f"checkpoint location {text!r}: control characters are not valid")
        pieces = [p for p in decoded.split("/") if p]
        if any(p in (".", "..") for p in pieces):
            raise ConfigError(
                f"checkpoint location {shown}: '.' and '..' are not valid in the prefix; "
                "name the prefix as it is"
            )
        return cls(scheme, bucket, "/".join(pieces))

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    @property
    def url(self) -> str:
        if self.is_local:
            return f"file://{self.prefix}"
        return f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")

    def __str__(self) -> str:
        return self.url

    def key(self, name: str) -> str:
        """The full object key of ``name`` under this location's prefix (for messages)."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def slug(self) -> str:
        """A directory name for this location: readable, short, and unique by its hash."""
        import hashlib

        readable = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{self.scheme}-{self.bucket}-{self.prefix}")
        digest = hashlib.sha256(self.url.encode()).hexdigest()[:12]
        return f"{readable.strip('_-.')[:60]}-{digest}"


def staging_root() -> Path:
    """``$PREEMPTIBLE_STAGING_DIR``, else ``$XDG_CACHE_HOME/preemptible/staging``, else
    ``~/.cache/preemptible/staging``: where URLs' checkpoints are committed before the upload."""
    given = env_str("PREEMPTIBLE_STAGING_DIR")
    if given:
        return Path(given)
    cache = os.environ.get("XDG_CACHE_HOME")
    base = Path(cache) if cache else Path.home() / ".cache"
    return base / "preemptible" / "staging"


def staging_dir(location: Location) -> Path:
    """The local directory ``location``'s checkpoints are committed in before the upload;
    ``ConfigError`` when it cannot be one (a file there, or above it), naming where it came
    from, rather than the bare "cannot be created: File exists" of the first mkdir."""
    if location.staging:
        staging = Path(location.staging)
        problem = not_a_directory(staging)
        if problem:
            raise ConfigError(f"the staging directory of {location}: {problem}")
        return staging
    root = staging_root()
    problem = not_a_directory(root)
    if problem:
        where = "PREEMPTIBLE_STAGING_DIR" if env_str("PREEMPTIBLE_STAGING_DIR") else "staging"
        raise ConfigError(
            f"{where}: {problem}; set PREEMPTIBLE_STAGING_DIR to a directory (made when "
            "missing) for the local copies of bucket checkpoints"
        )
    return root / location.slug()


def not_a_directory(path: Path) -> str | None:
    """What stops ``path`` from being (or becoming) a directory: it, or the nearest of its
    parents that exists, is a file (or another non-directory); None when nothing does.

    Each path is judged from one ``stat`` (and a look at the link when that finds nothing),
    so a directory that another process (another rank) makes meanwhile is never taken for a
    file."""
    dangling = "a symbolic link to nothing, not a directory"
    for at in (path, *path.parents):
        try:
            st = os.stat(at)
        except (FileNotFoundError, NotADirectoryError):
            if not os.path.islink(at):
                continue  # not there (or under a file): its parent decides
            kind = dangling
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                return None  # unreadable: the mkdir that follows says what is wrong
            kind = dangling
        else:
            if stat.S_ISDIR(st.st_mode):
                return None
            kind = "a file, not a directory" if stat.S_ISREG(st.st_mode) else "not a directory"
        if at == path:
            return f"{path} is {kind}"
        return f"{path} cannot be a directory: {at} is {kind}"
    return None


def local_or_url(value: str | os.PathLike[str]) -> Path | str:
    """A checkpoint location as the front ends and the supervisor keep it: a local ``Path``
    (``file:///abs/path`` included), or a URL string in its canonical form, checked
    (``ConfigError`` when bad)."""
    if isinstance(value, str) and is_url(value):
        location = Location.parse(value)
        return Path(location.prefix) if location.is_local else location.url
    return Path(value)


def staged_in(url: str, directory: str | os.PathLike[str]) -> Location:
    """The location ``url`` (a bucket's) staged in ``directory``, a local directory of the
    caller's (``CheckpointStore(staged_in(url, output_dir))``)."""
    location = Location.parse(url)
    if location.is_local:
        raise ConfigError(f"{url} is a local directory; use a bucket's URL ({_VALID})")
    return Location(location.scheme, location.bucket, location.prefix, os.fspath(directory))
