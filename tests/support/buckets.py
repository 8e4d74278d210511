"""Object storage for the checkpoint URL tests: one S3-protocol server per session (moto's
standalone server), a fresh bucket per test.

tests/services/with-services.sh starts the server and exports PREEMPTIBLE_TEST_S3_ENDPOINT;
without it the session starts its own (tests/services/s3.sh). The tests skip, with the reason,
only where the server cannot be started (moto[server] not installed, or
PREEMPTIBLE_TEST_S3_SKIP says why).

``s3_bucket`` gives a bucket's URL and the environment a child process needs to reach it (the
``AWS_*`` variables of the standard chain: endpoint, plain HTTP allowed, dummy keys, region),
and sets the same in the test process.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

S3_SCRIPT = Path(__file__).resolve().parent.parent / "services" / "s3.sh"

# every AWS variable that could point a child elsewhere (a developer's own profile or keys)
_AWS_CLEARED = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL_S3")


@dataclass
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    directory: Path | None  # None: started by someone else (with-services.sh)

    def env(self) -> dict[str, str]:
        """The standard chain's variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def create_bucket(self, name: str) -> None:
        # moto takes an unsigned request; the client under test is never used to make buckets
        request = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 200, answer.status

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """Every object under ``prefix`` in ``bucket``, read through boto3 (not the client
        under test): key (relative to ``prefix``) -> content."""
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, **_boto_keys())
        found: dict[str, bytes] = {}
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                body = s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
                found[item["Key"][len(prefix) :].lstrip("/")] = body
        return found

    def put(self, bucket: str, key: str, data: bytes) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, **_boto_keys()).put_object(
            Bucket=bucket, Key=key, Body=data
        )

    def delete(self, bucket: str, key: str) -> None:
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, **_boto_keys())
        s3.delete_object(Bucket=bucket, Key=key)


def _boto_keys() -> dict[str, str]:
    return {
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "region_name": "us-east-1",
    }


@dataclass
class Bucket:
    """A fresh bucket (an Azure container) on one of the protocol servers (``S3Server``,
    ``AzuriteServer``, ``GcsServer``): ``url`` is ``SCHEME://NAME/ckpt``; ``env`` for child
    processes; ``objects()``, ``put()`` and ``delete()`` read and write it through the server's
    own helpers, never the client under test."""

    server: Any
    name: str
    scheme: str = "s3"
    prefix: str = "ckpt"
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.name}/{self.prefix}"

    def objects(self) -> dict[str, bytes]:
        return self.server.objects(self.name, self.prefix + "/")

    def put(self, key: str, data: bytes) -> None:
        self.server.put(self.name, f"{self.prefix}/{key}", data)

    def delete(self, key: str) -> None:
        self.server.delete(self.name, f"{self.prefix}/{key}")


class Outages:
    """``stop()`` and ``start()`` of a server that its script (``script``) started for one
    test (``directory``; None: someone else's, never stopped)."""

    script: Path
    directory: Path | None

    def stop(self) -> None:
        """An outage until ``start()`` (same port, same data)."""
        self._ctl("stop")

    def start(self) -> None:
        self._ctl("start")

    def _ctl(self, command: str) -> None:
        assert self.directory is not None, "not ours to stop: use the test's own server"
        subprocess.run(
            ["bash", str(self.script), command, str(self.directory)], check=True, timeout=60
        )


@contextlib.contextmanager
def started_s3(env: dict[str, str] | None = None) -> Iterator[S3Server]:
    """A server of our own, stopped after (a test that kills its server uses one). ``env``:
    the server's own settings (moto's ``INITIAL_NO_AUTH_ACTION_COUNT=0`` checks keys)."""
    directory = Path(tempfile.mkdtemp(prefix="preemptible-s3-"))
    up = subprocess.run(
        ["bash", str(S3_SCRIPT), "up", str(directory / "s3")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    try:
        if up.returncode == 3:
            pytest.skip(f"no S3 test server: {up.stderr.strip()}")
        if up.returncode != 0:
            pytest.skip(f"could not start the S3 test server: {up.stderr.strip()}")
        yield S3Server(up.stdout.strip(), directory / "s3")
    finally:
        subprocess.run(["bash", str(S3_SCRIPT), "down", str(directory / "s3")], timeout=60)
        with contextlib.suppress(OSError):
            directory.rmdir()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    endpoint = os.environ.get("PREEMPTIBLE_TEST_S3_ENDPOINT")
    if endpoint:
        yield S3Server(endpoint, None)
        return
    if os.environ.get("PREEMPTIBLE_TEST_S3_SKIP"):
        pytest.skip(os.environ["PREEMPTIBLE_TEST_S3_SKIP"])
    with started_s3() as server:
        yield server


def fresh_bucket(
    server: Any,
    scheme: str,
    cleared: tuple[str, ...],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Bucket:
    """A fresh bucket (container) on ``server`` (its ``create_bucket``); the server's
    environment set in this process too, with a staging directory of the test's own, and
    ``cleared``, the cloud's variables that could point a child elsewhere, removed."""
    name = f"t-{uuid.uuid4().hex[:20]}"  # 3-63 characters: lowercase, digits, single dashes
    server.create_bucket(name)
    env = {**server.env(), "PREEMPTIBLE_STAGING_DIR": str(tmp_path / "staging")}
    for key in cleared:  # children inherit this process's environment
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Bucket(server, name, scheme, env=env)


def new_bucket(server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A fresh bucket on ``server`` (see ``fresh_bucket``)."""
    return fresh_bucket(server, "s3", _AWS_CLEARED, tmp_path, monkeypatch)


@pytest.fixture
def s3_bucket(s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A fresh bucket on the session's S3 server (see the module docstring)."""
    return new_bucket(s3_server, tmp_path, monkeypatch)


@pytest.fixture
def own_s3_server() -> Iterator[S3Server]:
    """An S3 server for this test alone, for the tests that kill or stall theirs."""
    with started_s3() as server:
        yield server


def store_on(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, machine: str, **kw: Any
) -> Any:
    """A ``CheckpointStore`` of ``bucket`` as a machine of its own (its own staging directory)
    sees it."""
    from preemptible import CheckpointStore

    monkeypatch.setenv("PREEMPTIBLE_STAGING_DIR", str(tmp_path / machine))
    return CheckpointStore(bucket.url, **kw)


def save_and_flush(store: Any, step: int, data: bytes) -> bool:
    """Save ``data`` as step ``step`` and wait for its upload: True once it is committed."""
    store.save(step, lambda tmp: tmp.write_bytes(data))
    return bool(store.flush(time.monotonic() + 60))


def settled(store: Any, timeout: float = 60) -> None:
    """Wait until ``store``'s uploader is idle: a flush returns once the checkpoint is
    committed, and the retention of older ones in the bucket goes on after it."""
    assert store.mirror.settle(time.monotonic() + timeout), "the retention did not end"


def manifests(bucket: Bucket) -> dict[str, dict[str, Any]]:
    """The bucket's manifests (key relative to the prefix -> content)."""
    return {k: json.loads(v) for k, v in bucket.objects().items() if k.startswith("manifests/")}
