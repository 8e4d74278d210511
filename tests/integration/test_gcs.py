"""The GCS test server itself: what the gs:// checkpoint tests rely on fake-gcs-server for.

The object-store commit protocol needs two things from the server: a create-only put that fails
when the name exists (the manifest is written last, once), and an update that fails when the
generation it names is stale (GCS's x-goog-if-generation-match, which obstore sends for an
update from the ``version`` a read gave). These tests check that fake-gcs-server, reached
through obstore configured from the environment alone (``GOOGLE_SERVICE_ACCOUNT``, as
``tests.support.gcs`` sets it for child processes), honours both, reading the result back with
plain HTTP. The gs:// cases of the tests of what must hold on every cloud (the ``bucket`` and
``own_bucket`` fixtures') cover the rest: the commit protocol, a new machine's exact resume, an
outage (the server's data kept on disk across its stop), the doctor.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from tests.support.buckets import Bucket

obstore = pytest.importorskip("obstore")

pytestmark = pytest.mark.timeout(120)


def _store(bucket: Bucket):  # type: ignore[no-untyped-def]
    from obstore.store import GCSStore

    # nothing but the environment the fixture set: the same chain a child process reads
    return GCSStore(
        bucket.name,
        prefix=bucket.prefix,
        client_options={"timeout": "10s", "connect_timeout": "2s", "allow_http": True},
        retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=5)},
    )


def test_conditional_puts_are_honoured(gs_bucket: Bucket) -> None:
    store = _store(gs_bucket)
    obstore.put(store, "manifest.json", b"first", mode="create")
    with pytest.raises(obstore.exceptions.AlreadyExistsError):
        obstore.put(store, "manifest.json", b"second", mode="create")

    meta = obstore.head(store, "manifest.json")
    name = f"{gs_bucket.prefix}/manifest.json"
    assert meta["version"] == gs_bucket.server.generation(gs_bucket.name, name)
    old = {"e_tag": meta["e_tag"], "version": meta["version"]}
    obstore.put(store, "manifest.json", b"updated", mode=old)
    with pytest.raises(obstore.exceptions.PreconditionError):
        obstore.put(store, "manifest.json", b"stale", mode=old)
    # read back with plain HTTP against the JSON API, not with the client under test
    assert gs_bucket.objects() == {"manifest.json": b"updated"}


def test_unusable_credentials_are_one_line_at_start(
    gs_bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fake-gcs-server checks no credentials, so the refusal a real bucket gives cannot be had
    here; what can: a service-account file that is not there, or holds a key that is not one,
    is one line naming the location, never a traceback at the first save."""
    from preemptible import CheckpointRemoteError, CheckpointStore

    missing = tmp_path / "no-such-account.json"
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT", str(missing))
    with pytest.raises(CheckpointRemoteError) as info:
        CheckpointStore(gs_bucket.url)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint location {gs_bucket.url}: cannot set up the client")
    assert str(missing) in message

    key = "-----BEGIN PRIVATE KEY-----\nbm90LWEta2V5\n-----END PRIVATE KEY-----\n"
    account = {"client_email": "run@p.iam.gserviceaccount.com", "private_key": key}
    broken = tmp_path / "account.json"
    broken.write_text(json.dumps({**account, "private_key_id": "k1"}))
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT", str(broken))
    with pytest.raises(CheckpointRemoteError) as info:
        CheckpointStore(gs_bucket.url)
    message = str(info.value)
    assert "\n" not in message and "bm90LWEta2V5" not in message
    assert message.startswith(f"checkpoint location {gs_bucket.url}: cannot set up the client")
