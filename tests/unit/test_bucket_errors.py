"""What a bucket's error says: one line, from the service's code, and never a secret (an Azure
SAS token rides in the request's query string, which obstore's errors quote)."""

from __future__ import annotations

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
