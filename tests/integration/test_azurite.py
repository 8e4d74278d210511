"""The Azure test server itself: what the az:// checkpoint tests rely on Azurite for.

The object-store commit protocol needs two things from the server: a create-only put that fails
when the name exists (the manifest is written last, once), and an update that fails when the
ETag it names is stale. These tests check that Azurite, reached through the client preemption
uses (obstore) configured from the environment alone (as ``tests.support.azure_blob`` sets it
for child processes), honours both. And that what cannot work on Azure (a container that does
not exist, a key the service refuses) is one line at the store's start, as on S3; and that an
account key with an HTTP endpoint (not the emulator mode) works as obstore documents it. An
outage is tested with the other clouds' (``test_bucket_store.py``, fixture ``own_bucket``).
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from tests.support.azure_blob import ACCOUNT
from tests.support.buckets import Bucket

obstore = pytest.importorskip("obstore")


def _store(container: Bucket):  # type: ignore[no-untyped-def]
    from obstore.store import AzureStore

    # nothing but the environment the fixture set: the same chain a child process reads
    return AzureStore(
        container.name,
        prefix=container.prefix,
        client_options={"timeout": "10s", "connect_timeout": "2s"},
        retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=5)},
    )


def test_conditional_puts_are_honoured(az_container: Bucket) -> None:
    store = _store(az_container)
    obstore.put(store, "manifest.json", b"first", mode="create")
    with pytest.raises(obstore.exceptions.AlreadyExistsError):
        obstore.put(store, "manifest.json", b"second", mode="create")

    old = obstore.head(store, "manifest.json")["e_tag"]
    obstore.put(store, "manifest.json", b"updated", mode={"e_tag": old})
    with pytest.raises(obstore.exceptions.PreconditionError):
        obstore.put(store, "manifest.json", b"stale", mode={"e_tag": old})
    # read back with Azure's own SDK, not the client under test
    assert az_container.objects() == {"manifest.json": b"updated"}


def test_a_missing_container_or_a_wrong_key_is_one_line_at_start(
    az_container: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    from preemptible import CheckpointRemoteError, CheckpointStore

    with pytest.raises(CheckpointRemoteError) as info:
        CheckpointStore(f"az://no-such-{az_container.name}/ckpt")
    assert "\n" not in str(info.value)
    assert "does not exist (ContainerNotFound)" in str(info.value)

    wrong = "bm90LXRoZS1rZXktMTIzNA=="  # base64 of not-the-key-1234
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", wrong)
    with pytest.raises(CheckpointRemoteError) as info:
        CheckpointStore(az_container.url)
    message = str(info.value)
    assert "\n" not in message
    assert f"checkpoint location {az_container.url}: the credentials were refused" in message
    assert wrong not in message and az_container.server.env()["AZURE_STORAGE_ACCOUNT_KEY"] not in (
        message
    )


def test_an_http_endpoint_with_an_account_key_as_obstore_reads_it(
    az_container: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not the emulator mode: an account, its key and an endpoint, as for any Azure-compatible
    service; plain HTTP allowed by obstore's own variable, AZURE_ALLOW_HTTP."""
    from preemptible import CheckpointStore

    server = az_container.server
    for key in ("AZURE_STORAGE_USE_EMULATOR", "AZURITE_BLOB_STORAGE_URL"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", f"{server.endpoint}/{ACCOUNT}")
    monkeypatch.setenv("AZURE_ALLOW_HTTP", "true")
    store = CheckpointStore(az_container.url)
    assert store.lock()
    store.save(3, lambda tmp: tmp.write_bytes(b"three"))
    assert store.flush(time.monotonic() + 60)
    store.unlock()
    assert b"three" in az_container.objects().values()
