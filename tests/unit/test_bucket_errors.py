"""What a bucket's error says: one line, from the service's code, and never a secret (an Azure
SAS token rides in the request's query string, which obstore's errors quote)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from preemptible import CheckpointStore, ConfigError
from preemptible.checkpoint._buckets import first_line, refused
from preemptible.checkpoint._location import Location

SAS = "sv=2024-11-04&ss=b&srt=sco&sp=rwdlac&sig=c2VjcmV0LXNpZ25hdHVyZQ%3D%3D"


def obstore_error(status: str, code: str) -> Exception:
    return RuntimeError(
        f"Generic MicrosoftAzure error: Error performing GET "
        f"https://acct.blob.core.windows.net/ckpt?restype=container&comp=list&{SAS} in 10ms - "
        f"Server returned non-2xx status code: {status}: <?xml version='1.0'?>\n"
        f"<Error><Code>{code}</Code><Message>...</Message></Error>\n\nDebug source: ..."
    )


def test_a_url_in_an_error_loses_its_query_string() -> None:
    line = first_line(obstore_error("403 Forbidden", "AuthenticationFailed"))
    assert "sig=" not in line and "c2VjcmV0" not in line
    assert "https://acct.blob.core.windows.net/ckpt?..." in line


def test_refused_names_the_code_in_one_line_without_the_token() -> None:
    loc = Location.parse("az://ckpt/run")
    refused_key = str(refused(loc, obstore_error("403 Forbidden", "AuthenticationFailed")))
    assert "the credentials were refused (AuthenticationFailed)" in refused_key
    missing = str(refused(loc, obstore_error("404 Not Found", "ContainerNotFound")))
    assert "'ckpt' does not exist (ContainerNotFound)" in missing
    unreachable = str(refused(loc, RuntimeError(f"error sending request for https://x/?{SAS}")))
    assert "cannot be reached" in unreachable
    for message in (refused_key, missing, unreachable):
        assert "\n" not in message and "sig=" not in message and "c2VjcmV0" not in message


def test_a_url_in_an_error_loses_its_user_and_password() -> None:
    # what obstore said for AWS_ENDPOINT_URL=http://AKIAUSER:SUPERSECRET@127.0.0.1:1
    error = RuntimeError(
        "Generic S3 error: Error performing list request: Error performing GET "
        "http://AKIAUSER:SUPERSECRET@127.0.0.1:1/bucket?list-type=2&prefix=manifests%2F in "
        "3.0s, after 10 retries, max_retries: 10, retry_timeout: 60s  - HTTP error: error "
        "sending request"
    )
    line = first_line(error)
    assert "SUPERSECRET" not in line and "AKIAUSER" not in line
    assert "GET http://127.0.0.1:1/bucket?... in" in line
    unreachable = str(refused(Location.parse("s3://bucket/x"), error))
    assert "SUPERSECRET" not in unreachable and "cannot be reached" in unreachable


def test_a_refusal_names_the_chain_of_its_own_cloud_only() -> None:
    chains = {"s3": "AWS_ACCESS_KEY_ID", "gs": "GOOGLE_SERVICE_ACCOUNT", "az": "AZURE_STORAGE_"}
    for scheme, own in chains.items():
        line = str(
            refused(
                Location.parse(f"{scheme}://ckpt/run"),
                obstore_error("403 Forbidden", "AccessDenied"),
            )
        )
        assert "the credentials were refused (AccessDenied)" in line and own in line, line
        others = [name for other, name in chains.items() if other != scheme]
        assert not any(name in line for name in others), line
        assert "\n" not in line


@pytest.mark.parametrize(
    ("scheme", "variable", "allow"),
    [
        ("s3", "AWS_ENDPOINT_URL", "AWS_ALLOW_HTTP"),
        ("s3", "AWS_ENDPOINT_URL_S3", "AWS_ALLOW_HTTP"),
        ("az", "AZURE_STORAGE_ENDPOINT", "AZURE_ALLOW_HTTP"),
        ("gs", "GOOGLE_SERVICE_ACCOUNT", "GOOGLE_ALLOW_HTTP"),
    ],
)
def test_a_plain_http_endpoint_without_its_variable_is_named_at_start(
    scheme: str, variable: str, allow: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """obstore fails every request to an http:// endpoint it was not allowed with "HTTP error:
    builder error": the line names the endpoint and the variable that allows it instead, from
    the configuration, before any request (port 9 answers nothing)."""
    for name in list(os.environ):  # the developer's own cloud settings
        if name.startswith(("AWS_", "AZURE_", "AZURITE_", "GOOGLE_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws profile
    monkeypatch.setenv("PREEMPTIBLE_STAGING_DIR", str(tmp_path / "staging"))
    endpoint = "http://user:SECRET@127.0.0.1:9/acct"
    if scheme == "gs":  # Google's endpoint is the service-account file's gcs_base_url
        account = tmp_path / "account.json"
        account.write_text(json.dumps({"gcs_base_url": endpoint, "disable_oauth": True}))
        monkeypatch.setenv(variable, str(account))
    else:
        monkeypatch.setenv(variable, endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "c2VjcmV0")
    url = f"{scheme}://ckpt/run"
    with pytest.raises(ConfigError) as info:
        CheckpointStore(url)
    line = str(info.value)
    assert line.startswith(f"checkpoint location {url}: the endpoint http://127.0.0.1:9/acct")
    assert "is plain HTTP" in line and f"{allow}=true" in line
    assert "SECRET" not in line and "builder error" not in line and "\n" not in line
    # with the variable the client is built and goes on to its first request
    from preemptible.checkpoint._buckets import _plain_http_endpoint

    monkeypatch.setenv(allow, "true")
    assert _plain_http_endpoint(scheme) is None
