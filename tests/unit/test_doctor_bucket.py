"""The doctor's checkpoint-location check without a server: what it says before any request
(no location, a local one, a bad URL, an Azure URL without an account), which source of each
cloud's chain it names, and that a server that never answers costs it its deadline, no more."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from preemptible.doctor import _bucket
from preemptible.doctor._bucket import check_location, credential_source

CLOUD_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_SKIP_SIGNATURE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT",
    "GOOGLE_SERVICE_ACCOUNT",
    "GOOGLE_SERVICE_ACCOUNT_PATH",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "AZURE_STORAGE_USE_EMULATOR",
    "AZURITE_BLOB_STORAGE_URL",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCESS_KEY",
    "AZURE_STORAGE_MASTER_KEY",
    "AZURE_STORAGE_TOKEN",
    "AZURE_STORAGE_CLIENT_ID",
    "AZURE_CLIENT_ID",
    "AZURE_STORAGE_CLIENT_SECRET",
    "AZURE_CLIENT_SECRET",
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_USE_AZURE_CLI",
    "AZURE_STORAGE_ENDPOINT",
    "AZURE_ENDPOINT",
)


@pytest.fixture(autouse=True)
def no_cloud(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    for name in CLOUD_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws, no gcloud credentials


def test_no_location_no_line_and_a_local_one_is_info() -> None:
    assert check_location(None) is None and check_location("") is None
    local = check_location("runs/ckpt")
    assert local is not None and (local.status, local.detail) == (
        "info",
        "runs/ckpt: a local directory (its checks are the run's own)",
    )


def test_a_bad_url_is_one_warn_line_naming_the_valid_forms() -> None:
    check = check_location("s3://")
    assert check is not None and check.status == "warn"
    assert check.detail.startswith("s3://: no bucket or container; use s3://BUCKET/PREFIX")
    assert "\n" not in check.detail


def test_azure_without_an_account_says_so_before_any_request() -> None:
    check = check_location("az://ckpts/run")
    assert check is not None and check.status == "warn"
    assert check.detail == (
        "az://ckpts/run: no storage account: set AZURE_STORAGE_ACCOUNT_NAME; credentials: "
        "a managed identity (instance metadata), no Azure credentials set"
    )


def test_each_source_is_named_by_its_variable_never_its_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert credential_source("s3").startswith("the instance role")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDSECRET1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-value-2")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://user:pw-3@minio.local:9000/?x=pw-4")
    s3 = credential_source("s3")
    assert s3 == (
        "keys from the environment (AWS_ACCESS_KEY_ID), "
        "endpoint AWS_ENDPOINT_URL=https://minio.local:9000/"
    )
    assert credential_source("gs").startswith("the VM's service account")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/secret/adc.json")
    assert credential_source("gs") == (
        "application default credentials (the file in GOOGLE_APPLICATION_CREDENTIALS)"
    )
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", "sv=2020&sig=pw-5")
    assert credential_source("az") == "the SAS token in AZURE_STORAGE_SAS_TOKEN, account acct"
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "pw-6")
    assert credential_source("az") == "the account key in AZURE_STORAGE_ACCOUNT_KEY, account acct"


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A server that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_server_that_never_answers_costs_the_deadline_not_more(
    silent_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("obstore")
    monkeypatch.setattr(_bucket, "PROBE_SECONDS", 1.0)
    for name, value in {
        "AWS_ENDPOINT_URL": silent_server,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    check = check_location("s3://ckpts/run")
    assert time.monotonic() - start < 5
    assert check is not None and check.status == "warn"
    assert check.detail.startswith("s3://ckpts/run: no answer within 1 s; credentials: keys")
