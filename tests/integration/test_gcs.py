"""The GCS test server itself: what the gs:// checkpoint tests rely on fake-gcs-server for.

The object-store commit protocol needs two things from the server: a create-only put that fails
when the name exists (the manifest is written last, once), and an update that fails when the
generation it names is stale (GCS's x-goog-if-generation-match, which obstore sends for an
update from the ``version`` a read gave). These tests check that fake-gcs-server, reached
through obstore configured from the environment alone (``GOOGLE_SERVICE_ACCOUNT``, as
``tests.support.gcs`` sets it for child processes), honours both, reading the result back with
plain HTTP. (The gs:// cases of the tests of what must hold on every cloud, the ``bucket``
fixture's, cover the rest: the commit protocol, a new machine's exact resume, the doctor.)
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.support.gcs import GcsBucket

obstore = pytest.importorskip("obstore")

pytestmark = pytest.mark.timeout(120)


def _store(bucket: GcsBucket):  # type: ignore[no-untyped-def]
    from obstore.store import GCSStore

    # nothing but the environment the fixture set: the same chain a child process reads
    return GCSStore(
        bucket.name,
        prefix=bucket.prefix,
        client_options={"timeout": "10s", "connect_timeout": "2s", "allow_http": True},
        retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=5)},
    )


def test_conditional_puts_are_honoured(gs_bucket: GcsBucket) -> None:
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
