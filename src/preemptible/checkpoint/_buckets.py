"""The object-store client of a checkpoint URL: obstore, imported only when a URL is used.

obstore (one Rust wheel for S3, GCS and Azure) does conditional puts (``mode="create"`` is
``If-None-Match: *``; an ``e_tag`` is ``If-Match``), multipart uploads with parts in flight
at once, timeouts, and retries of 5xx answers and dropped connections with exponential
backoff. Credentials and endpoints come only from each cloud's standard chain, which obstore
reads from the environment (``AWS_*`` including ``AWS_ENDPOINT_URL``; Google's application
default credentials; ``AZURE_STORAGE_*``) or the instance's metadata service; an AWS profile
(``AWS_PROFILE`` or ``~/.aws``) is read through boto3 when it is installed. Nothing here
logs a credential: errors are mapped to one line that names the URL and what was refused.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointRemoteError, ConfigError
from ._location import Location

if TYPE_CHECKING:
    from obstore.store import ObjectStore

REQUEST_TIMEOUT = 60.0
"""Seconds one request may take end to end (a multipart upload's part, a manifest, a GET)."""

CONNECT_TIMEOUT = 5.0

RETRY_TIMEOUT = 60.0
"""Seconds after the first try of a request when retries of 5xx and SlowDown stop."""

_TRUE = ("1", "true", "yes", "on")


# the variables that allow a plain-HTTP endpoint (any one allows it for every scheme, as
# _client_options reads them) and the one a message names for each scheme: obstore's own
_ALLOW_HTTP = (
    "AWS_ALLOW_HTTP",
    "AZURE_ALLOW_HTTP",
    "AZURE_STORAGE_ALLOW_HTTP",
    "GOOGLE_ALLOW_HTTP",
)
_ALLOW_NAMED = {"s3": "AWS_ALLOW_HTTP", "az": "AZURE_ALLOW_HTTP", "gs": "GOOGLE_ALLOW_HTTP"}
# where each client takes its endpoint from, as obstore reads the environment (GCS has no
# variable: the endpoint is the service-account file's gcs_base_url)
_ENDPOINTS = {
    "s3": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"),
    "az": ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT"),
}


def _http_allowed() -> bool:
    return any(os.environ.get(name, "").lower() in _TRUE for name in _ALLOW_HTTP)


def _client_options() -> dict[str, Any]:
    options: dict[str, Any] = {
        "timeout": timedelta(seconds=REQUEST_TIMEOUT),
        "connect_timeout": timedelta(seconds=CONNECT_TIMEOUT),
    }
    # explicit client options replace obstore's reading of these from the environment
    # (AZURE_ALLOW_HTTP and GOOGLE_ALLOW_HTTP are obstore's own names for Azure and GCS, read
    # for an endpoint that is plain HTTP: an emulator, a compatible service; Azure's emulator
    # mode allows HTTP itself)
    if _http_allowed():
        options["allow_http"] = True
    return options


def _plain_http_endpoint(scheme: str) -> str | None:
    """``http://host (NAME)`` when the client of ``scheme`` is pointed at a plain-HTTP endpoint
    that no variable allows (obstore then fails every request with "builder error", which
    names neither the endpoint nor the variable); None otherwise."""
    if _http_allowed():
        return None
    if scheme == "az" and os.environ.get("AZURE_STORAGE_USE_EMULATOR", "").lower() in _TRUE:
        return None  # the emulator's mode allows HTTP itself
    found = [(name, os.environ.get(name, "")) for name in _ENDPOINTS.get(scheme, ())]
    if scheme == "gs":
        found.append(_google_base_url())
    for name, value in found:
        if value.strip().lower().startswith("http://"):
            shown = _QUERY.sub(r"\1", _USERINFO.sub(r"\1", value.strip()))  # no secrets
            return f"{shown} ({name})"
    return None


def _google_base_url() -> tuple[str, str]:
    """(where, URL) of the service-account file's ``gcs_base_url``, ("", "") when none."""
    import json

    for name in (
        "GOOGLE_SERVICE_ACCOUNT",
        "GOOGLE_SERVICE_ACCOUNT_PATH",
        "GOOGLE_SERVICE_ACCOUNT_KEY",
    ):
        value = os.environ.get(name, "")
        if not value:
            continue
        try:
            text = value if name.endswith("_KEY") else Path(value).read_text()
            account = json.loads(text)
        except (OSError, ValueError, RecursionError):
            return "", ""  # obstore says what is wrong with the file itself
        url = account.get("gcs_base_url") if isinstance(account, dict) else None
        return (f"gcs_base_url in {name}", url) if isinstance(url, str) else ("", "")
    return "", ""


def _retry() -> dict[str, Any]:
    return {
        "max_retries": 10,
        "retry_timeout": timedelta(seconds=RETRY_TIMEOUT),
        "backoff": {
            "init_backoff": timedelta(milliseconds=100),
            "max_backoff": timedelta(seconds=5),
            "base": 2,
        },
    }


def _aws_profile_provider() -> Any | None:
    """boto3's credential chain when an AWS profile is configured and no keys are exported
    (obstore reads keys, web identity and the instance role, but not ``~/.aws``)."""
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return None
    configured = os.environ.get("AWS_PROFILE") or any(
        (Path.home() / ".aws" / name).is_file() for name in ("credentials", "config")
    )
    if not configured:
        return None
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None
    try:
        return Boto3CredentialProvider(boto3.Session())
    except Exception:  # no usable profile: obstore's own chain (instance role) is tried
        return None


def open_bucket(location: Location) -> ObjectStore:
    """An obstore store rooted at ``location``'s prefix."""
    try:
        from obstore import store as obs
    except ImportError:
        extra = {"s3": "s3", "gs": "gcs", "az": "azure"}.get(location.scheme, "cloud")
        raise ConfigError(
            f"checkpoint location {location}: the object-store client is not installed; "
            f"pip install 'preemptible[{extra}]'"
        ) from None
    plain = _plain_http_endpoint(location.scheme)
    if plain is not None:
        allow = _ALLOW_NAMED[location.scheme]
        raise ConfigError(
            f"checkpoint location {location}: the endpoint {plain} is plain HTTP, which the "
            f"client refuses unless {allow}=true is set: set it (an emulator, a service on "
            "your own network) or use an https:// endpoint"
        )
    prefix = location.prefix or None
    common: dict[str, Any] = {"client_options": _client_options(), "retry_config": _retry()}
    try:
        if location.scheme == "s3":
            provider = _aws_profile_provider()
            if provider is not None:
                common["credential_provider"] = provider
            return obs.S3Store(location.bucket, prefix=prefix, **common)
        if location.scheme == "gs":
            return obs.GCSStore(location.bucket, prefix=prefix, **common)
        if location.scheme == "az":
            return obs.AzureStore(location.bucket, prefix=prefix, **common)
    except Exception as exc:  # a configuration obstore refuses (a bad variable)
        raise CheckpointRemoteError(
            f"checkpoint location {location}: cannot set up the client "
            f"({type(exc).__name__}: {first_line(exc)})",
            None,
        ) from None
    raise ConfigError(f"checkpoint location {location}: not an object-store URL")


def first_line(exc: BaseException) -> str:
    """The first line of an obstore error (the rest is a debug dump of the request), with the
    query string of every URL in it cut off (an Azure SAS token travels there, ``sig=``) and
    any user and password before its host (an endpoint variable may carry them:
    ``AWS_ENDPOINT_URL=https://KEY:SECRET@host``, which obstore quotes as it was given)."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return _QUERY.sub(r"\1?...", _USERINFO.sub(r"\1", line))[:300]


_QUERY = re.compile(r"(\w+://[^\s?#]*)\?[^\s#]*")
_USERINFO = re.compile(r"(\w+://)[^\s/?#@]*@")


# each cloud's standard chain, named in a refusal: only the one of the scheme in use
_CHAINS = {
    "s3": "AWS's credential chain: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE "
    "(~/.aws) or the instance role",
    "gs": "Google's credential chain: GOOGLE_SERVICE_ACCOUNT, GOOGLE_APPLICATION_CREDENTIALS "
    "(application default credentials) or the VM's service account",
    "az": "Azure's credential chain: AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, "
    "a SAS token (AZURE_STORAGE_SAS_KEY), a service principal (AZURE_CLIENT_ID) or a managed "
    "identity",
}

_MISSING = {"NoSuchBucket", "ContainerNotFound", "BucketNotFound"}
_REFUSED = {
    "AccessDenied",
    "AllAccessDisabled",
    "AuthenticationFailed",
    "AuthorizationFailure",
    "AuthorizationPermissionMismatch",
    "ExpiredToken",
    "InvalidAccessKeyId",
    "InvalidToken",
    "SignatureDoesNotMatch",
}


def refused(location: Location, exc: BaseException) -> CheckpointRemoteError:
    """One line for a bucket we cannot use, from the service's error code."""
    text = str(exc)
    found = re.search(r"<Code>([A-Za-z]+)</Code>", text)
    status = re.search(r"status code: (\d{3})", text)
    code = found.group(1) if found else ""
    said = code or (f"HTTP {status.group(1)}" if status else first_line(exc))
    reason = "refused"
    if code in _MISSING or (not code and status and status.group(1) == "404"):
        reason = "missing"
        why = (
            f"bucket or container {location.bucket!r} does not exist ({said}); "
            "create it or fix the URL"
        )
    elif (
        code in _REFUSED
        or type(exc).__name__ == "PermissionDeniedError"
        or type(exc).__name__ == "UnauthenticatedError"
        or (status is not None and status.group(1) in ("401", "403"))
    ):
        why = f"the credentials were refused ({said}); check {_CHAINS[location.scheme]}"
    elif type(exc).__name__ == "InvalidPathError":
        # a key with a "." or ".." part, or an empty one: the client refuses to list past it
        reason = ""
        why = (
            f"an object there has a name the client cannot read ({first_line(exc)}); "
            "preemptible never writes such a name: remove that object"
        )
    elif "credential" in text.lower():  # a VM's metadata server may answer on the next try
        reason = ""
        why = f"no usable credentials from the cloud's standard chain ({first_line(exc)})"
    else:
        reason = ""
        why = f"cannot be reached ({first_line(exc)})"
    error = CheckpointRemoteError(f"checkpoint location {location}: {why}", None)
    error.reason = reason
    return error
