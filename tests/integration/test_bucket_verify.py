"""A download takes exactly the bytes a manifest lists: a file shorter or longer in the bucket
than its manifest says is caught and its checkpoint quarantined (never deleted), and the next
older one is brought back."""

from __future__ import annotations

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
