"""Faults between a run and its bucket, against a real S3-protocol server: throttling (503
SlowDown) is retried; a stalled server or one killed in the middle of an upload costs the
upload, never the exit by the deadline nor the checkpoints already in the bucket; a missing
bucket and refused credentials are one line at start."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from preemptible import CheckpointRemoteError, CheckpointStore
from tests.conftest import PY, ROOT, python_args, wait_for
from tests.support.buckets import Bucket, started_s3
from tests.support.faults import fault_proxy

pytestmark = pytest.mark.timeout(180)
NEWEST = re.compile(r"the newest checkpoint in the bucket is (\S+)")


def verified_manifests(bucket: Bucket) -> dict[str, int]:
    """Each committed step in the bucket -> its generation; every file it lists is there with
    the size and sha256 its manifest says."""
    objects = bucket.objects()
    found = {}
    for key, raw in objects.items():
        if not key.startswith("manifests/step-"):
            continue
        body = json.loads(raw)
        for entry in body["files"]:
            data = objects[f"uploads/{body['upload']}/{body['name']}"]
            assert len(data) == entry["size"], key
            assert hashlib.sha256(data).hexdigest() == entry["sha256"], key
        found[body["name"]] = int(key.rsplit("/", 1)[1][:10])
    return found


def test_slow_down_is_retried_with_backoff(
    s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fault_proxy(s3_bucket.server.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        proxy.refuse = 3  # the start's look at the bucket is throttled, and so on
        store = CheckpointStore(s3_bucket.url)
        assert store.lock()
        proxy.refuse = 3  # and the upload's requests
        store.save(1, lambda tmp: tmp.write_bytes(b"one"))
        assert store.flush(time.monotonic() + 60)
        assert proxy.refused == 6
    assert list(verified_manifests(s3_bucket)) == ["step-0000000001.ckpt"]


def test_slow_deletes_hold_up_no_upload(s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bucket's retention after an upload runs beside the uploads: deletes answered slowly
    (a throttled bucket) held the next upload, the stop's too, behind them."""
    with fault_proxy(s3_bucket.server.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        store = CheckpointStore(s3_bucket.url, keep=1)
        assert store.lock() and store.mirror is not None
        store.save(1, lambda tmp: tmp.write_bytes(b"one"))
        assert store.flush(time.monotonic() + 30)
        proxy.hold_deletes.set()
        store.save(2, lambda tmp: tmp.write_bytes(b"two"))  # its retention (of 1) is held
        assert store.flush(time.monotonic() + 30)
        store.save(3, lambda tmp: tmp.write_bytes(b"three"))
        assert store.flush(time.monotonic() + 10), "the upload waited for the deletes"
        assert not store.mirror.idle  # the retention is still held
        proxy.hold_deletes.clear()
        assert store.mirror.settle(time.monotonic() + 30)
    assert list(verified_manifests(s3_bucket)) == ["step-0000000003.ckpt"]


def test_a_missing_bucket_is_one_line_at_start(s3_bucket: Bucket) -> None:
    with pytest.raises(CheckpointRemoteError) as info:
        CheckpointStore("s3://no-such-bucket-here/ckpt")
    message = str(info.value)
    assert "\n" not in message
    assert "bucket or container 'no-such-bucket-here' does not exist (NoSuchBucket)" in message


def test_run_on_a_missing_bucket_is_one_line_and_exit_2_before_any_attempt(
    s3_bucket: Bucket, tmp_path: Path
) -> None:
    """The job would raise it at its handler after a traceback, and the supervisor then offer
    to resume from that very bucket: ``preemptible run`` asks the bucket first."""
    run = [PY, "-m", "preemptible", "run", "--home", str(tmp_path / "home")]
    where = ["--checkpoint-dir", "s3://no-such-bucket-here/ckpt"]
    done = subprocess.run(
        [*run, *where, "--", PY, "-c", "print('ran')"],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "bucket or container 'no-such-bucket-here' does not exist (NoSuchBucket)" in lines[0]
    assert "ran" not in done.stdout
    assert not list((tmp_path / "home").glob("runs/*/attempts/*")), "no attempt started"


def test_run_on_a_bucket_that_does_not_answer_goes_on_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """What may pass by itself is the job's to meet (its client retries): not refused."""
    import socket

    from preemptible.supervisor import _attempt_env

    with socket.socket() as sock:  # a port where nothing listens: connections are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setattr(_attempt_env, "BUCKET_CHECK_SECONDS", 0.5)
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        _attempt_env.check_bucket("s3://some-bucket/ckpt")
    said = "checkpoint location s3://some-bucket/ckpt: no answer within 0.5 s; the job will try"
    assert said in caplog.text, caplog.text


def test_refused_credentials_are_one_line_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    with started_s3({"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as server:  # keys are checked
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-1234")
        with pytest.raises(CheckpointRemoteError) as info:
            CheckpointStore("s3://some-bucket/ckpt")
    message = str(info.value)
    assert "\n" not in message
    assert "the credentials were refused (InvalidAccessKeyId)" in message
    assert "not-the-secret-1234" not in message and "testing" not in message


def train_args(bucket: Bucket) -> list[str]:
    return python_args(
        "train.py",
        "--ckpt",
        bucket.url,
        "--out",
        "o.pt",
        "--steps",
        "400",
        "--save-every",
        "2",
        "--step-sleep",
        "0.05",
        "--grace",
        "5",
    )


@pytest.mark.waits
def test_a_stalled_server_costs_the_upload_not_the_deadline(
    s3_bucket: Bucket, tmp_path: Path, spawn
) -> None:
    with fault_proxy(s3_bucket.server.endpoint) as proxy:
        run = spawn(train_args(s3_bucket), cwd=tmp_path, env={"AWS_ENDPOINT_URL": proxy.endpoint})
        run.wait_line(lambda line: line == "step 6", timeout=90)
        proxy.stall.set()  # from now on every request hangs
        run.wait_line(lambda line: line == "step 8", timeout=30)
        sent = time.monotonic()
        run.signal(signal.SIGTERM)
        assert run.wait(30) == 128 + signal.SIGTERM, run.output
        took = time.monotonic() - sent
    assert took < 5 + 1.5, (took, run.output)  # the grace period, and a little for the exit
    said = [line for line in run.lines if "did not finish in time" in line]
    assert len(said) == 1, run.output
    newest = NEWEST.search(said[0])
    assert newest and newest.group(1) in verified_manifests(s3_bucket), said


@pytest.mark.waits
def test_the_server_killed_during_an_upload_leaves_the_bucket_intact(
    s3_bucket: Bucket, tmp_path: Path, spawn
) -> None:
    server = spawn([PY, str(ROOT / "tests" / "support" / "faults.py"), s3_bucket.server.endpoint])
    port = server.wait_line(lambda line: line.startswith("listening "), 30).split()[1]
    run_dir = tmp_path / "run"  # where a supervisor would read the attempt's record
    run = spawn(
        train_args(s3_bucket),
        cwd=tmp_path,
        env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "PREEMPTIBLE_RUN_DIR": str(run_dir)},
    )
    run.wait_line(lambda line: line == "step 7", timeout=90)
    # the server dies as the next upload's first file starts
    seen = len(server.lines)
    upload = re.compile(r"^PUT .*/uploads/[^/]+/(step-\d+\.ckpt)$")
    line = wait_for(
        lambda: next((m for x in server.lines[seen:] if (m := upload.match(x))), None),
        30,
        "an upload after step 7",
    )
    server.signal(signal.SIGKILL)
    cut = line.group(1)
    sent = time.monotonic()
    run.signal(signal.SIGTERM)
    assert run.wait(30) == 128 + signal.SIGTERM, run.output
    assert time.monotonic() - sent < 5 + 1.5, run.output
    in_bucket = verified_manifests(s3_bucket)  # read from the real server, behind the dead one
    assert cut not in in_bucket and max(in_bucket) < cut, (cut, in_bucket)
    said = [line for line in run.lines if "did not finish in time" in line or "failed" in line]
    assert said and all(
        (m := NEWEST.search(line)) and m.group(1) == max(in_bucket) for line in said
    ), run.output
    record = json.loads((run_dir / "record.json").read_text())
    assert record["remote_checkpoint"] == f"{s3_bucket.url}/{max(in_bucket)}", record


def test_a_bucket_gone_between_the_start_and_the_lock_is_one_line_without_secrets(
    s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server stops answering after the store's start (its first look at the bucket) and
    before the lock's takeover: the lock raises one line that says so, and the password of an
    endpoint given with one is not in it. It raised the client's multi-line dump of the
    request, the endpoint with its password included."""
    with fault_proxy(s3_bucket.server.endpoint) as proxy:
        port = proxy.endpoint.rsplit(":", 1)[1]
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://user:SECRET-{port}@127.0.0.1:{port}")
        store = CheckpointStore(s3_bucket.url)
        proxy.cut.set()  # the server is gone
        with pytest.raises(CheckpointRemoteError) as info:
            store.lock()
    said = str(info.value)
    assert said.startswith(f"checkpoint location {s3_bucket.url}: cannot be reached ("), said
    assert "\n" not in said and "SECRET" not in said, said
