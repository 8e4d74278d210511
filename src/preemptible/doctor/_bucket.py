"""The doctor's checkpoint-location check: can this machine reach the bucket of a checkpoint URL,
and with which credentials.

The probe is the very one a run makes at start (the first request of ``RemoteCheckpoints``, and
its one line for a missing bucket, refused credentials or an unreachable service), so the doctor
says what the run would. It runs in a thread of its own with a deadline: the client retries an
unreachable service for up to a minute, and the doctor must never hang.

Which credentials: the first source of the cloud's standard chain that the client would use,
read from the variables and files that select it, named by the variable or the file, never by
its value. The order is obstore's (AWS: keys, then web identity, then the container's or the
instance's role; an AWS profile is read through boto3 when no keys are exported, as
``checkpoint._buckets`` does. Google: a service account given by variable, then application
default credentials, then the metadata server. Azure: the emulator, a bearer token, an account
key, workload identity, a service principal, a SAS token, the Azure CLI, then a managed
identity).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from .._errors import ConfigError
from ._check import INFO, OK, WARN, Check

if TYPE_CHECKING:
    from ..checkpoint._location import Location

NAME = "checkpoint location"

PROBE_SECONDS = 15.0
"""How long the doctor waits for the bucket's answer before it says there was none."""

_TRUE = ("1", "true", "yes", "on")


def _set(*names: str) -> str | None:
    """The first of ``names`` set (non-empty) in the environment."""
    return next((n for n in names if os.environ.get(n)), None)


def _endpoint(name: str) -> str:
    """``name=URL`` with any user, password or query left out of the URL."""
    parts = urlsplit(os.environ[name])
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return f"{name}={urlunsplit((parts.scheme, host, parts.path, '', ''))}"


def _aws() -> str:
    if os.environ.get("AWS_SKIP_SIGNATURE", "").lower() in _TRUE:
        found = "no credentials: unsigned requests (AWS_SKIP_SIGNATURE)"
    elif os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        token = " + AWS_SESSION_TOKEN" if os.environ.get("AWS_SESSION_TOKEN") else ""
        found = f"keys from the environment (AWS_ACCESS_KEY_ID{token})"
    elif os.environ.get("AWS_PROFILE") or any(
        (Path.home() / ".aws" / n).is_file() for n in ("credentials", "config")
    ):
        profile = os.environ.get("AWS_PROFILE", "default")
        found = f"the AWS profile {profile!r} (~/.aws, read through boto3)"
    elif os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE") and os.environ.get("AWS_ROLE_ARN"):
        found = "web identity (AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN)"
    elif _set("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        found = "the container's task role (AWS_CONTAINER_CREDENTIALS_*)"
    else:
        found = "the instance role (EC2 metadata service), no AWS variables or profile set"
    endpoint = _set("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
    return f"{found}, endpoint {_endpoint(endpoint)}" if endpoint else found


def _google() -> str:
    account = _set("GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH")
    if account:
        return f"the service account file in {account}"
    if os.environ.get("GOOGLE_SERVICE_ACCOUNT_KEY"):
        return "the service account key in GOOGLE_SERVICE_ACCOUNT_KEY"
    if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return "application default credentials (the file in GOOGLE_APPLICATION_CREDENTIALS)"
    adc = Path.home() / ".config" / "gcloud" / "application_default_credentials.json"
    if adc.is_file():
        return "application default credentials (gcloud's, in ~/.config/gcloud)"
    return "the VM's service account (GCE metadata server), no Google credentials set"


def _azure() -> str:
    if os.environ.get("AZURE_STORAGE_USE_EMULATOR", "").lower() in _TRUE:
        where = _endpoint("AZURITE_BLOB_STORAGE_URL") if _set("AZURITE_BLOB_STORAGE_URL") else ""
        return "the storage emulator's development account (AZURE_STORAGE_USE_EMULATOR)" + (
            f", endpoint {where}" if where else ""
        )
    account = _set("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT")
    if os.environ.get("AZURE_STORAGE_TOKEN"):
        found = "a bearer token (AZURE_STORAGE_TOKEN)"
    elif key := _set(
        "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_MASTER_KEY"
    ):
        found = f"the account key in {key}"
    elif _set("AZURE_STORAGE_CLIENT_ID", "AZURE_CLIENT_ID") and _set("AZURE_FEDERATED_TOKEN_FILE"):
        found = "workload identity (AZURE_CLIENT_ID and AZURE_FEDERATED_TOKEN_FILE)"
    elif _set("AZURE_STORAGE_CLIENT_ID", "AZURE_CLIENT_ID") and _set(
        "AZURE_STORAGE_CLIENT_SECRET", "AZURE_CLIENT_SECRET"
    ):
        found = "a service principal (AZURE_CLIENT_ID and AZURE_CLIENT_SECRET)"
    elif sas := _set("AZURE_STORAGE_SAS_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        found = f"the SAS token in {sas}"
    elif os.environ.get("AZURE_USE_AZURE_CLI", "").lower() in _TRUE:
        found = "the Azure CLI's login (AZURE_USE_AZURE_CLI)"
    else:
        found = "a managed identity (instance metadata), no Azure credentials set"
    if account:
        found = f"{found}, account {os.environ[account]}"
    endpoint = _set("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT")
    return f"{found}, endpoint {_endpoint(endpoint)}" if endpoint else found


def credential_source(scheme: str) -> str:
    """Where the client of ``scheme`` (s3, gs, az) would take its credentials from here."""
    return {"s3": _aws, "gs": _google, "az": _azure}[scheme]()


def _missing(scheme: str) -> str | None:
    """What the client cannot do without, known before any request."""
    if scheme == "az" and not (
        os.environ.get("AZURE_STORAGE_USE_EMULATOR", "").lower() in _TRUE
        or _set("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT")
    ):
        return "no storage account: set AZURE_STORAGE_ACCOUNT_NAME"
    return None


def check_location(value: str | None) -> Check | None:
    """The check of a checkpoint location (``--checkpoint-dir``/PREEMPTIBLE_CHECKPOINT_DIR);
    None when none is given."""
    from ..checkpoint._location import Location, is_url

    if not value:
        return None
    if not is_url(value):
        return Check(NAME, INFO, f"{value}: a local directory (its checks are the run's own)")
    try:
        location = Location.parse(value)
    except ConfigError as exc:  # the line names what is wrong and what is valid
        return Check(NAME, WARN, _unprefixed(str(exc)))
    if location.scheme == "file":
        return Check(NAME, INFO, f"{location}: a local directory (its checks are the run's own)")
    source = credential_source(location.scheme)
    missing = _missing(location.scheme)
    if missing:
        return Check(NAME, WARN, f"{location}: {missing}; credentials: {source}")
    error = _probe(location)
    if error is None:
        return Check(NAME, OK, f"{location}: reachable; credentials: {source}")
    return Check(
        NAME,
        WARN,
        f"{_unprefixed(error)}; credentials: {source}",
        "a run would stop at its start with this line: fix what it names",
    )


def _unprefixed(line: str) -> str:
    """The run's error line without its "checkpoint location " (the check's own name)."""
    return line.removeprefix(f"{NAME} ")


def _probe(location: Location) -> str | None:
    """None when the bucket answered the run's first request; else the run's one line."""
    from ..checkpoint._mirror import probe

    error = probe(location, PROBE_SECONDS)
    return None if error is None else str(error)
