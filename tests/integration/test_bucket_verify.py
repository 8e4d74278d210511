"""A download takes exactly the bytes a manifest lists: a file shorter or longer in the bucket
than its manifest says is caught and its checkpoint quarantined (never deleted), and the next
older one is brought back."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from tests.support.buckets import Bucket, manifests, save_and_flush, store_on

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("damage", [b"good", b"good two and more"], ids=["shorter", "longer"])
def test_a_file_of_another_size_quarantines_its_checkpoint(
    damage: bytes, s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog
) -> None:
    writer = store_on(s3_bucket, monkeypatch, tmp_path, "a")
    assert writer.lock()
    assert save_and_flush(writer, 1, b"good one")
    assert save_and_flush(writer, 2, b"good two")
    writer.unlock()
    body = manifests(s3_bucket)["manifests/step-0000000002.ckpt/0000000001.json"]
    s3_bucket.put(f"uploads/{body['upload']}/step-0000000002.ckpt", damage)
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        reader = store_on(s3_bucket, monkeypatch, tmp_path, "b")
    newest = reader.latest()
    assert newest is not None and newest.step == 1 and newest.path.read_bytes() == b"good one"
    assert "quarantined" in caplog.text
    assert "quarantine/step-0000000002.ckpt/0000000001.json" in s3_bucket.objects()
    assert reader.mirror is not None  # what the exit's lines name as the newest in the bucket
    assert reader.mirror.newest_in_bucket() == "step-0000000001.ckpt"


GOOD_SHA = "0" * 64
EMPTY_SHA = hashlib.sha256(b"").hexdigest()  # what a negative size reads as


@pytest.mark.parametrize(
    ("change", "raw"),
    [
        ({"files": [{"path": ""}]}, None),
        ({"files": ["x"]}, None),
        ({"files": [{"path": "", "size": -1, "sha256": EMPTY_SHA}]}, None),
        ({"kind": "link"}, None),
        (
            {"kind": "dir", "dirs": ["a"], "files": [{"path": "a", "size": 1, "sha256": GOOD_SHA}]},
            None,
        ),
        ({"kind": "dir", "files": [{"path": "x" * 256, "size": 1, "sha256": GOOD_SHA}]}, None),
        ({"kind": "dir", "files": [{"path": "a\x00b", "size": 1, "sha256": GOOD_SHA}]}, None),
        ({"kind": "dir", "dirs": ["d/" + "é" * 128], "files": []}, None),
        ({"epoch": "1"}, None),
        ({"epoch": 10**6}, None),
        ({"seq": None}, None),
        ({}, b"[" * 100_000 + b"]" * 100_000),
        ({}, b"pad"),
    ],
    ids=[
        "no-size",
        "entry-text",
        "size-negative",
        "kind",
        "file-is-dir",
        "name-too-long",
        "name-nul",
        "dir-too-long",
        "epoch-text",
        "epoch-ahead",
        "seq-null",
        "nested-deep",
        "too-large",
    ],
)
def test_a_manifest_this_version_does_not_write_is_never_taken_nor_stops_a_start(
    change: dict,
    raw: bytes | None,
    s3_bucket: Bucket,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """A manifest in the bucket that is not what this version writes (a field of another type,
    JSON nested past the parser's depth, an object too large to be a manifest) is skipped or
    quarantined, and a new machine starts from the newest checkpoint that does verify, and
    becomes the writer: it used to stop every start with an exception until someone deleted the
    object by hand. One of an epoch writer.json never reached used to hide every checkpoint (a
    start from zero)."""
    from preemptible.checkpoint import _remote

    monkeypatch.setattr(
        _remote, "MANIFEST_MAX", 1000, raising=False
    )  # "too-large": 2 KB is past it
    writer = store_on(s3_bucket, monkeypatch, tmp_path, "a")
    assert writer.lock()
    assert save_and_flush(writer, 1, b"good one")
    assert save_and_flush(writer, 2, b"good two")
    writer.unlock()
    key = "manifests/step-0000000002.ckpt/0000000001.json"
    body = manifests(s3_bucket)[key]
    data = json.dumps({**body, **change}).encode()
    if raw == b"pad":  # a manifest as written, but larger than one can be
        raw = data + b" " * 2000
    s3_bucket.put(key, raw if raw is not None else data)
    reader = store_on(s3_bucket, monkeypatch, tmp_path, "b")
    newest = reader.latest()
    assert newest is not None and newest.step == 1 and newest.path.read_bytes() == b"good one"
    assert key in s3_bucket.objects()  # never deleted
    assert reader.lock()  # and it becomes the writer there


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        json.dumps({"format": 1, "epoch": "1", "adopted": []}).encode(),
        json.dumps({"format": 1, "epoch": 1, "adopted": [{"key": 1}]}).encode(),
        json.dumps({"format": 2, "epoch": 1, "adopted": []}).encode(),
    ],
    ids=["not-json", "epoch-a-string", "adopted-not-keys", "another-format"],
)
def test_a_writer_json_this_version_does_not_write_fails_closed(
    raw: bytes, s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """writer.json replaced by what this version does not write: a new machine stops at its
    start with one line naming the object, and the bucket is left as it was. It used to be
    taken for no writer at all (a start from zero whose takeover then hid every committed
    checkpoint for good), or to fail as 'cannot be reached (unhashable type...)'."""
    from preemptible import CheckpointRemoteError

    writer = store_on(s3_bucket, monkeypatch, tmp_path, "a")
    assert writer.lock()
    assert save_and_flush(writer, 1, b"good one")
    writer.unlock()
    s3_bucket.put("writer.json", raw)
    before = s3_bucket.objects()
    with pytest.raises(CheckpointRemoteError) as raised:
        store_on(s3_bucket, monkeypatch, tmp_path, "b")
    said = str(raised.value)
    assert said == (
        f"checkpoint location {s3_bucket.url}: {s3_bucket.prefix}/writer.json is not one this "
        "version of preemptible writes (format 1), so which checkpoints there are committed is "
        "not known; nothing was changed. Put back the writer.json preemptible wrote, or give "
        "this run a prefix of its own"
    ), said
    assert s3_bucket.objects() == before


def test_an_object_named_with_dot_dot_is_named_at_start_not_taken_for_an_outage(
    s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A key with a '..' part among the manifests (planted, or another tool's): the client
    refuses to list past it, so no start can read the bucket; the line says which object, not
    that the bucket 'cannot be reached'. Nothing is written outside staging."""
    from preemptible import CheckpointRemoteError

    s3_bucket.put("manifests/../0000000001.json", b"{}")
    with pytest.raises(CheckpointRemoteError) as raised:
        store_on(s3_bucket, monkeypatch, tmp_path, "b")
    said = str(raised.value)
    assert "cannot be reached" not in said, said
    assert f'"{s3_bucket.prefix}/manifests/../0000000001.json"' in said, said
    assert said.endswith("preemptible never writes such a name: remove that object"), said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_a_checkpoint_named_past_what_a_file_system_holds_is_skipped(
    s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A committed manifest whose checkpoint name is longer than a file name can be (planted,
    as this version never writes one): a new machine starts from the newest checkpoint it can
    hold. It used to stop every start with 'could not save checkpoint ...: File name too
    long'."""
    writer = store_on(s3_bucket, monkeypatch, tmp_path, "a")
    assert writer.lock()
    assert save_and_flush(writer, 1, b"good one")
    writer.unlock()
    [body] = manifests(s3_bucket).values()
    name = "n" * 300
    s3_bucket.put(f"uploads/{body['upload']}/{name}", b"good one")
    s3_bucket.put(f"manifests/{name}/0000000001.json", json.dumps({**body, "seq": 9}).encode())
    reader = store_on(s3_bucket, monkeypatch, tmp_path, "b")
    newest = reader.latest()
    assert newest is not None and newest.step == 1 and newest.path.read_bytes() == b"good one"
