"""The Azure test server itself: what the az:// checkpoint tests rely on Azurite for.

The object-store commit protocol needs two things from the server: a create-only put that fails
when the name exists (the manifest is written last, once), and an update that fails when the
ETag it names is stale. These tests check that Azurite, reached through the client preemption
uses (obstore) configured from the environment alone (as ``tests.support.azure_blob`` sets it
for child processes), honours both. And that what cannot work on Azure (a container that does
not exist, a key the service refuses) is one line at the store's start, as on S3; that an outage
of the service costs an upload, never the container's checkpoints; and that an account key with
an HTTP endpoint (not the emulator mode) works as obstore documents it.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests.support.azure_blob import ACCOUNT, AzuriteServer, new_container
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


def test_an_outage_costs_an_upload_never_the_containers_checkpoints(
    own_azurite: AzuriteServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Azurite stopped under a run (tests/services/azurite.sh stop): the save meanwhile commits
    locally and its upload does not finish by its deadline; the container keeps the checkpoint
    it had; once the service is back, the next save goes up and a new machine resumes from it."""
    from preemptible import CheckpointStore

    container = new_container(own_azurite, tmp_path, monkeypatch)
    store = CheckpointStore(container.url)
    assert store.lock()
    store.save(1, lambda tmp: tmp.write_bytes(b"one"))
    assert store.flush(time.monotonic() + 60)
    own_azurite.stop()
    try:
        store.save(2, lambda tmp: tmp.write_bytes(b"two"))
        assert not store.flush(time.monotonic() + 2)
        latest = store.latest()  # committed here all the same
        assert latest is not None and latest.step == 2
    finally:
        own_azurite.start()
    assert b"one" in container.objects().values()
    store.save(3, lambda tmp: tmp.write_bytes(b"three"))
    assert store.flush(time.monotonic() + 60)
    store.unlock()

    monkeypatch.setenv("PREEMPTIBLE_STAGING_DIR", str(tmp_path / "new-machine"))
    newest = CheckpointStore(container.url).latest()
    assert newest is not None and newest.step == 3 and newest.path.read_bytes() == b"three"
