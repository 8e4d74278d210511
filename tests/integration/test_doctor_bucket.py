"""``preemptible doctor --checkpoint-dir URL`` against the real protocol servers: one line that
says whether the bucket is reachable, naming the source of the credentials (never a secret), or
what is wrong, as the run itself would say it at its start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.buckets import Bucket
from tests.support.env import CLEAN

pytestmark = pytest.mark.timeout(120)


def location_check(env: dict[str, str], *args: str) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "preemptible", "doctor", "--json", *args],
        env={**os.environ, **CLEAN, "PREEMPTIBLE_DMI_DIR": "/nonexistent", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    found = [c for c in json.loads(out.stdout) if c["name"] == "checkpoint location"]
    assert len(found) == 1, out.stdout
    return found[0]


def test_a_reachable_bucket_names_its_credentials_never_the_secret(bucket: Bucket) -> None:
    check = location_check(bucket.env, "--checkpoint-dir", bucket.url)
    assert check["status"] == "ok", check
    assert check["detail"].startswith(f"{bucket.url}: reachable; credentials: "), check
    source = {
        "s3": "AWS_ACCESS_KEY_ID",
        "az": "AZURE_STORAGE_USE_EMULATOR",
        "gs": "the service account file in GOOGLE_SERVICE_ACCOUNT",
    }[bucket.url[:2]]
    assert source in check["detail"], check
    # fake-gcs-server takes no key: its service-account file has none to leak
    secrets = [v for k, v in bucket.env.items() if "SECRET" in k or k.endswith("_KEY")]
    assert secrets or bucket.url.startswith("gs:"), bucket.env
    assert not any(s in json.dumps(check) for s in secrets), check


def test_a_missing_bucket_from_the_environment_is_a_warn_line(s3_bucket: Bucket) -> None:
    url = f"s3://no-such-{s3_bucket.name}/ckpt"
    check = location_check({**s3_bucket.env, "PREEMPTIBLE_CHECKPOINT_DIR": url})
    assert check["status"] == "warn", check
    assert check["detail"].startswith(f"{url}: bucket or container "), check
    assert "does not exist (NoSuchBucket)" in check["detail"], check
    assert "AWS_ACCESS_KEY_ID" in check["detail"], check  # which credentials were tried
