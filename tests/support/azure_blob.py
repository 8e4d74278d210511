"""Azure Blob Storage for the checkpoint URL tests: Azurite, Azure's own emulator, one server per
session, a fresh container per test.

tests/services/with-services.sh starts it (tests/services/azurite.sh installs it with npm into
a cache directory the first time) and exports PREEMPTIBLE_TEST_AZURITE_ENDPOINT; without it the
session starts its own. The tests skip, with the reason, only where Azurite cannot be installed
or started here (no node/npm, no registry: PREEMPTIBLE_TEST_AZURITE_SKIP says why).

``az_container`` gives an ``az://`` URL and the environment a child process needs to reach it:
the variables of Azure's standard chain as obstore reads them, pointed at the emulator
(``AZURE_STORAGE_USE_EMULATOR`` with ``AZURITE_BLOB_STORAGE_URL``, and the emulator's public
development account), and sets the same in the test process. It has the shape of
``tests.support.buckets.Bucket`` (``url``, ``env``, ``objects()``, ``put()``, ``delete()``), so
that a test can take either.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.buckets import Bucket, Outages, fresh_bucket

AZURITE_SCRIPT = Path(__file__).resolve().parent.parent / "services" / "azurite.sh"

# Azurite's development account: public, documented, the same in every emulator (not a secret)
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

# every Azure variable that could point a client elsewhere or at other credentials (a
# developer's own account, a service principal, a SAS token)
_AZURE_CLEARED = (
    "AZURE_STORAGE_ENDPOINT",
    "AZURE_ENDPOINT",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_TOKEN",
    "AZURE_STORAGE_CLIENT_ID",
    "AZURE_CLIENT_ID",
    "AZURE_STORAGE_CLIENT_SECRET",
    "AZURE_CLIENT_SECRET",
    "AZURE_STORAGE_TENANT_ID",
    "AZURE_TENANT_ID",
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_USE_AZURE_CLI",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_USE_FABRIC_ENDPOINT",
)


@dataclass
class AzuriteServer(Outages):
    script = AZURITE_SCRIPT
    endpoint: str  # http://127.0.0.1:PORT, the blob service's root (no account)
    directory: Path | None  # None: started by someone else (with-services.sh)

    def env(self) -> dict[str, str]:
        """Azure's standard variables, as obstore reads them, pointing at this emulator."""
        return {
            "AZURE_STORAGE_USE_EMULATOR": "true",
            "AZURITE_BLOB_STORAGE_URL": self.endpoint,
            "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": ACCOUNT_KEY,
        }

    def _service(self) -> Any:
        """Azure's own SDK, not the client under test, for set-up and reading back."""
        try:
            from azure.storage.blob import BlobServiceClient
        except ImportError:
            pytest.skip("azure-storage-blob is not installed (it reads the emulator back)")
        conn = (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
            f"BlobEndpoint={self.endpoint}/{ACCOUNT};"
        )
        return BlobServiceClient.from_connection_string(
            conn, connection_timeout=10, read_timeout=60
        )

    def create_bucket(self, name: str) -> None:  # a container
        self._service().create_container(name)

    def objects(self, container: str, prefix: str = "") -> dict[str, bytes]:
        """Every blob under ``prefix`` in ``container``: name (relative to ``prefix``) ->
        content."""
        client = self._service().get_container_client(container)
        return {
            blob.name[len(prefix) :].lstrip("/"): client.download_blob(blob.name).readall()
            for blob in client.list_blobs(name_starts_with=prefix)
        }

    def put(self, container: str, name: str, data: bytes) -> None:
        client = self._service().get_container_client(container)
        client.upload_blob(name, data, overwrite=True)

    def delete(self, container: str, name: str) -> None:
        self._service().get_container_client(container).delete_blob(name)


@contextlib.contextmanager
def started_azurite() -> Iterator[AzuriteServer]:
    """An emulator of our own, removed after (a test that stops its server uses one)."""
    directory = Path(tempfile.mkdtemp(prefix="preemptible-azurite-")) / "azurite"
    up = subprocess.run(
        ["bash", str(AZURITE_SCRIPT), "up", str(directory)],
        capture_output=True,
        text=True,
        timeout=360,  # the first time it installs Azurite with npm
    )
    try:
        if up.returncode != 0:
            reason = (up.stderr.strip().splitlines() or [f"exit code {up.returncode}"])[-1]
            pytest.skip(f"could not start Azurite: {reason}")
        yield AzuriteServer(up.stdout.strip(), directory)
    finally:
        subprocess.run(["bash", str(AZURITE_SCRIPT), "down", str(directory)], timeout=60)
        with contextlib.suppress(OSError):
            directory.parent.rmdir()


@pytest.fixture(scope="session")
def azurite() -> Iterator[AzuriteServer]:
    endpoint = os.environ.get("PREEMPTIBLE_TEST_AZURITE_ENDPOINT")
    if endpoint:
        yield AzuriteServer(endpoint, None)
        return
    if os.environ.get("PREEMPTIBLE_TEST_AZURITE_SKIP"):
        pytest.skip(os.environ["PREEMPTIBLE_TEST_AZURITE_SKIP"])
    with started_azurite() as server:
        yield server


def new_container(server: AzuriteServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A fresh container on ``server`` (see ``fresh_bucket``)."""
    return fresh_bucket(server, "az", _AZURE_CLEARED, tmp_path, monkeypatch)


@pytest.fixture
def az_container(azurite: AzuriteServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A fresh container on the session's Azurite (see the module docstring)."""
    return new_container(azurite, tmp_path, monkeypatch)


@pytest.fixture
def own_azurite() -> Iterator[AzuriteServer]:
    """An Azurite for this test alone, for the tests that stop theirs."""
    with started_azurite() as server:
        yield server


@pytest.fixture(params=["s3", "az", "gs"])
def bucket(request: pytest.FixtureRequest) -> Bucket:
    """A fresh bucket on each protocol server in turn: moto's S3 (``s3_bucket``), Azurite
    (``az_container``) and fake-gcs-server (``gs_bucket``), for the tests of what must hold on
    every cloud. Each one skips on its own where its server cannot be started."""
    fixture = {"s3": "s3_bucket", "az": "az_container", "gs": "gs_bucket"}[request.param]
    found: Bucket = request.getfixturevalue(fixture)
    return found


@pytest.fixture(params=["az", "gs"])
def own_bucket(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Bucket:
    """A fresh bucket on a server of this test's own that the test may stop and start
    (``bucket.server.stop()``): Azurite, then fake-gcs-server (S3's outages go through a fault
    proxy in front of moto instead)."""
    from tests.support.gcs import new_gcs_bucket

    if request.param == "az":
        return new_container(request.getfixturevalue("own_azurite"), tmp_path, monkeypatch)
    return new_gcs_bucket(request.getfixturevalue("own_gcs"), tmp_path, monkeypatch)
