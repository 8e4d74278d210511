"""A checkpoint store on a URL, against a real S3-protocol server (moto's, tests/services/s3.sh):
each save commits in local staging and goes up; a store on a fresh staging directory (a new
machine) brings the newest committed checkpoint back, verified."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from preemptible import CheckpointStore
from tests.conftest import wait_for
from tests.support.buckets import Bucket, settled
from tests.support.faults import fault_proxy

pytestmark = pytest.mark.timeout(120)


def new_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str) -> None:
    monkeypatch.setenv("PREEMPTIBLE_STAGING_DIR", str(tmp_path / name))


def write_dir(tmp: Path) -> None:
    (tmp / "sub").mkdir(parents=True)
    (tmp / "model.bin").write_bytes(b"m" * 70_000)
    (tmp / "sub" / "opt.bin").write_bytes(b"o" * 10)


def test_saves_go_up_and_a_new_machine_brings_the_newest_back(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = CheckpointStore(bucket.url, keep=2)
    assert store.lock()
    payloads = {step: os.urandom(50_000 + step) for step in range(1, 5)}
    for step, data in payloads.items():
        store.save(step, lambda tmp, data=data: tmp.write_bytes(data))
        assert store.flush(time.monotonic() + 60)
    store.commit("named.ckpt", write_dir)
    assert store.flush(time.monotonic() + 60)
    settled(store)  # the retention after the last upload
    store.unlock()
    # the bucket holds the newest two step checkpoints, each behind its manifest
    keys = bucket.objects()
    manifests = sorted(k for k in keys if k.startswith("manifests/step-"))
    assert [k.split("/")[1] for k in manifests] == ["step-0000000003.ckpt", "step-0000000004.ckpt"]

    new_machine(monkeypatch, tmp_path, "elsewhere")
    again = CheckpointStore(bucket.url, keep=2)
    assert again.directory != store.directory
    newest = again.latest()
    assert newest is not None and newest.step == 4
    assert newest.path.read_bytes() == payloads[4]
    named = again.directory / "named.ckpt"
    assert (named / "model.bin").read_bytes() == b"m" * 70_000
    assert (named / "sub" / "opt.bin").read_bytes() == b"o" * 10


def test_a_staging_copy_as_new_is_used_as_it_is(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = CheckpointStore(bucket.url)
    assert store.lock()
    store.save(7, lambda tmp: tmp.write_bytes(b"seven"))
    assert store.flush(time.monotonic() + 60)
    store.unlock()
    newest = store.latest()
    assert newest is not None
    before = newest.path.stat().st_ino
    again = CheckpointStore(bucket.url)  # the same machine: staging has it already
    latest = again.latest()
    assert latest is not None and latest.path.stat().st_ino == before


def test_a_newer_checkpoint_replaces_one_waiting_to_go_up(
    s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fault_proxy(s3_bucket.server.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        store = CheckpointStore(s3_bucket.url, keep=5)
        assert store.lock()
        proxy.stall.set()
        store.save(1, lambda tmp: tmp.write_bytes(b"one"))  # its upload hangs
        wait_for(lambda: any("step-0000000001" in r for r in proxy.requests), 30, "upload 1")
        store.save(2, lambda tmp: tmp.write_bytes(b"two"))  # waits behind it
        store.save(3, lambda tmp: tmp.write_bytes(b"three"))  # and replaces it
        proxy.stall.clear()  # the held request drops; the client sends it again
        assert store.flush(time.monotonic() + 60)
    names = {k.split("/")[1] for k in s3_bucket.objects() if k.startswith("manifests/")}
    assert names == {"step-0000000001.ckpt", "step-0000000003.ckpt"}
    assert not [p for p in store.directory.iterdir() if p.name.startswith(".upload-")]


def test_a_flush_waits_for_the_commit_not_for_the_retention_after_it(
    s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The bucket stalls right after a checkpoint's manifest is written, as the retention of
    the older ones begins: a stop's flush is done (that checkpoint is in the bucket, the record
    names it) and says so, instead of waiting out its deadline on deletes and then saying the
    upload did not finish while naming that very checkpoint as the bucket's newest."""
    with fault_proxy(s3_bucket.server.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        store = CheckpointStore(s3_bucket.url, keep=1)
        assert store.lock()
        store.save(1, lambda tmp: tmp.write_bytes(b"one"))
        assert store.flush(time.monotonic() + 30)
        proxy.stall_after = f"PUT /{s3_bucket.name}/{s3_bucket.prefix}/manifests/step-0000000002"
        store.save(2, lambda tmp: tmp.write_bytes(b"two"))  # retires step 1 after its commit
        started = time.monotonic()
        assert store.mirror is not None
        with caplog.at_level("WARNING", logger="preemptible"):
            assert store.mirror.flush(time.monotonic() + 8, say=True)  # as a stop's flush
        took = time.monotonic() - started
        assert proxy.stall.is_set()  # the retention is what hangs
        proxy.stall.clear()  # the retention goes on
        settled(store)
    assert took < 4, took
    said = [r.getMessage() for r in caplog.records]
    assert f"preemptible: uploaded step-0000000002.ckpt to {s3_bucket.url}" in said, said
    assert not any("did not finish" in line for line in said), said
    names = {k.split("/")[1] for k in s3_bucket.objects() if k.startswith("manifests/")}
    assert "step-0000000002.ckpt" in names


def test_an_outage_costs_an_upload_never_the_buckets_checkpoints(
    own_bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service stopped under a run (its script's ``stop``): the save meanwhile commits
    locally and its upload does not finish by its deadline; the bucket keeps the checkpoint it
    had; once the service is back, the next save goes up and a new machine resumes from it."""
    store = CheckpointStore(own_bucket.url)
    assert store.lock()
    store.save(1, lambda tmp: tmp.write_bytes(b"one"))
    assert store.flush(time.monotonic() + 60)
    own_bucket.server.stop()
    try:
        store.save(2, lambda tmp: tmp.write_bytes(b"two"))
        assert not store.flush(time.monotonic() + 2)
        latest = store.latest()  # committed here all the same
        assert latest is not None and latest.step == 2
    finally:
        own_bucket.server.start()
    assert b"one" in own_bucket.objects().values()
    store.save(3, lambda tmp: tmp.write_bytes(b"three"))
    assert store.flush(time.monotonic() + 60)
    store.unlock()

    new_machine(monkeypatch, tmp_path, "new-machine")
    newest = CheckpointStore(own_bucket.url).latest()
    assert newest is not None and newest.step == 3 and newest.path.read_bytes() == b"three"
