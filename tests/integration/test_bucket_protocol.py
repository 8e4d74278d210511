"""The commit protocol on a bucket, against a real S3-protocol server: a checkpoint exists only
once its manifest does; two writers cannot commit the same name; a writer replaced by a
takeover cannot commit after it; retention removes the manifest before the files; a
checkpoint whose files do not verify is quarantined, never deleted."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from preemptible import CheckpointStore
from preemptible._files import host_tag
from preemptible.checkpoint import _remote
from tests.support.buckets import Bucket, manifests, save_and_flush, settled
from tests.support.faults import fault_proxy

pytestmark = pytest.mark.timeout(120)


def store_on(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, machine: str, **kw: int
) -> CheckpointStore:
    """A store of ``bucket`` as a machine of its own (its own staging directory) sees it."""
    monkeypatch.setenv("PREEMPTIBLE_STAGING_DIR", str(tmp_path / machine))
    return CheckpointStore(bucket.url, **kw)


def test_files_without_a_manifest_are_never_read(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    writer = store_on(bucket, monkeypatch, tmp_path, "a")
    assert writer.lock()
    assert save_and_flush(writer, 2, b"two")
    writer.unlock()
    # an upload that never got its manifest (its writer killed), newer than the committed one
    bucket.put("uploads/9-00aa/step-0000000009.ckpt", b"half of nine")
    # and a manifest whose name is not a checkpoint's (it would land on staging's lock file)
    body = next(iter(manifests(bucket).values()))
    hostile = json.dumps({**body, "name": ".preemptible.lock"}).encode()
    bucket.put("manifests/.preemptible.lock/0000000001.json", hostile)
    reader = store_on(bucket, monkeypatch, tmp_path, "b")
    newest = reader.latest()
    assert newest is not None and newest.step == 2 and newest.path.read_bytes() == b"two"
    assert not (reader.directory / ".preemptible.lock").exists()
    # a takeover leaves another writer's upload in progress alone (it is not an hour old)
    assert reader.lock()
    assert "uploads/9-00aa/step-0000000009.ckpt" in bucket.objects()
    # an hour later (the hour made nothing here), the next takeover removes it, and only it
    monkeypatch.setattr(_remote, "ABANDONED_AFTER", -60.0)
    before = set(bucket.objects())
    assert store_on(bucket, monkeypatch, tmp_path, "c").lock()
    assert before - set(bucket.objects()) == {"uploads/9-00aa/step-0000000009.ckpt"}


def test_two_writers_cannot_commit_the_same_name(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog
) -> None:
    writer = store_on(bucket, monkeypatch, tmp_path, "a")
    assert writer.lock()
    assert save_and_flush(writer, 1, b"one")
    # another writer commits step 5, generation 1, right after this one looked for the
    # generations of step 5 (the listing is taken as it was before that commit, the race)
    other = {**next(iter(manifests(bucket).values())), "name": "step-0000000005.ckpt"}
    bucket.put("manifests/step-0000000005.ckpt/0000000001.json", json.dumps(other).encode())
    assert writer.mirror is not None
    remote = writer.mirror.remote
    listing = remote._list
    monkeypatch.setattr(
        remote, "_list", lambda prefix: [] if "step-0000000005" in prefix else listing(prefix)
    )
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        assert not save_and_flush(writer, 5, b"five")
    assert "another writer committed step-0000000005.ckpt generation 1 first" in caplog.text
    kept = manifests(bucket)["manifests/step-0000000005.ckpt/0000000001.json"]
    assert kept == other  # the create-only put did not replace it


@pytest.mark.parametrize("met", ["before", "by the stop"])
def test_a_replaced_writer_s_stop_says_its_checkpoint_did_not_reach_the_bucket(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog, met: str
) -> None:
    """A run whose location another start took over saves on: its stop must not exit as if its
    checkpoint were in the bucket (the next machine resumes from an older one), whether an
    upload before met the takeover (said once then) or the stop's own upload is the first."""
    old = store_on(bucket, monkeypatch, tmp_path, "old")
    assert old.lock()
    assert save_and_flush(old, 1, b"old one")
    new = store_on(bucket, monkeypatch, tmp_path, "new")
    assert new.lock()  # the takeover
    if met == "before":
        assert not save_and_flush(old, 2, b"old two")
    step = 3 if met == "before" else 2
    old.save(step, lambda tmp: tmp.write_bytes(b"the stop's"))  # the stop's save
    assert old.mirror is not None
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        assert not old.mirror.flush(time.monotonic() + 30, say=True)  # the stop's exit
    said = [r.getMessage() for r in caplog.records if "is not in" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert said[0].startswith(f"preemptible: step-{step:010d}.ckpt is not in {bucket.url}"), said
    assert said[0].endswith("the newest this run put there is step-0000000001.ckpt"), said
    assert not any(f"step-{step:010d}" in k for k in manifests(bucket))


def test_a_writer_replaced_by_a_takeover_cannot_commit_after_it(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog
) -> None:
    old = store_on(bucket, monkeypatch, tmp_path, "old")
    assert old.lock()
    assert save_and_flush(old, 1, b"old one")
    new = store_on(bucket, monkeypatch, tmp_path, "new")  # resumed elsewhere
    assert new.lock()  # the takeover
    with caplog.at_level(logging.ERROR, logger="preemptible"):
        assert not save_and_flush(old, 2, b"old two")
    # the line names the run that took over: a second start with the same URL, to look for
    assert f"another writer (host {host_tag()}, pid {os.getpid()}, its writer since " in (
        caplog.text
    )
    assert not any("step-0000000002" in k for k in manifests(bucket))
    # the old writer's manifest written in the gap after its last look at writer.json (the
    # check skipped here to land in that gap) carries the old epoch: nobody reads it
    assert old.mirror is not None
    old.mirror.remote.fenced = False
    monkeypatch.setattr(old.mirror.remote, "_check_fence", lambda: None)
    assert save_and_flush(old, 3, b"old three")
    assert any("step-0000000003" in k for k in manifests(bucket))
    assert save_and_flush(new, 3, b"new three")  # the same name: the next generation
    reader = store_on(bucket, monkeypatch, tmp_path, "reader")
    newest = reader.latest()
    assert newest is not None and newest.step == 3 and newest.path.read_bytes() == b"new three"


def test_retention_removes_the_manifest_before_the_files(
    s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with fault_proxy(s3_bucket.server.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        store = store_on(s3_bucket, monkeypatch, tmp_path, "a", keep=1)
        assert store.lock()
        assert save_and_flush(store, 1, b"one")
        upload = next(iter(manifests(s3_bucket).values()))["upload"]
        assert save_and_flush(store, 2, b"two")
        settled(store)  # the retention of step 1 runs after step 2's commit
        requests = list(proxy.requests)
    deletes = [r for r in requests if r.startswith("DELETE") or r.startswith("POST")]
    gone_manifest = next(i for i, r in enumerate(deletes) if "manifests/step-0000000001.ckpt" in r)
    gone_files = next(i for i, r in enumerate(deletes) if f"uploads/{upload}/" in r)
    assert gone_manifest < gone_files, requests
    keys = s3_bucket.objects()
    assert not any("step-0000000001" in k for k in keys), sorted(keys)


SAID = {
    "other bytes": "sha256 differs",
    "missing": "missing from the bucket",
    # a key with "416" in it (upload ids are random hex) is no 416 answer: it is still missing
    "missing, 416 in its key": "missing from the bucket",
    "empty": "shorter than the manifest says",  # the ranged GET is answered 416
}


@pytest.mark.parametrize("damage", list(SAID))
def test_a_checkpoint_that_does_not_verify_is_quarantined_not_deleted(
    damage: str, bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog
) -> None:
    writer = store_on(bucket, monkeypatch, tmp_path, "a")
    assert writer.lock()
    assert save_and_flush(writer, 1, b"good one")
    assert save_and_flush(writer, 2, b"good two")
    writer.unlock()
    manifest = "manifests/step-0000000002.ckpt/0000000001.json"
    body = manifests(bucket)[manifest]
    damaged = f"uploads/{body['upload']}/step-0000000002.ckpt"
    if damage == "missing":
        bucket.delete(damaged)
    elif damage == "missing, 416 in its key":
        bucket.put(manifest, json.dumps({**body, "upload": "1-41641641641641"}).encode())
    elif damage == "empty":
        bucket.put(damaged, b"")
    else:
        bucket.put(damaged, b"bad! two")  # the same size, other bytes
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        reader = store_on(bucket, monkeypatch, tmp_path, "b")
    newest = reader.latest()
    assert newest is not None and newest.step == 1 and newest.path.read_bytes() == b"good one"
    said = SAID[damage]
    assert said in caplog.text and "quarantined" in caplog.text, caplog.text
    keys = bucket.objects()
    assert "quarantine/step-0000000002.ckpt/0000000001.json" in keys
    assert manifest in keys  # never deleted
    assert damage != "other bytes" or keys[damaged] == b"bad! two"
    # the next machine skips it without downloading it again
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        third = store_on(bucket, monkeypatch, tmp_path, "c")
    assert said not in caplog.text
    latest = third.latest()
    assert latest is not None and latest.step == 1
