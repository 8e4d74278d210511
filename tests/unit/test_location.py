"""Checkpoint locations: a URL is parsed once, a bad one is one line naming what is valid, and a
URL is never taken for a relative directory (``Path("s3://b/p")`` collapses the ``//``)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from preemptible import ConfigError
from preemptible.checkpoint._location import (
    Location,
    is_url,
    not_a_directory,
    staging_dir,
    staging_root,
)
from preemptible.frontend import checkpoint_directory


@pytest.mark.parametrize(
    ("url", "scheme", "bucket", "prefix"),
    [
        ("s3://bucket/prefix", "s3", "bucket", "prefix"),
        ("s3://bucket/a/b/", "s3", "bucket", "a/b"),
        ("s3://bucket", "s3", "bucket", ""),
        ("gs://my_bucket.example/runs/1", "gs", "my_bucket.example", "runs/1"),
        ("az://container/p", "az", "container", "p"),
        ("azure://container/p", "az", "container", "p"),
        ("file:///abs/path/", "file", "", "/abs/path"),
    ],
)
def test_valid_urls(url: str, scheme: str, bucket: str, prefix: str) -> None:
    assert is_url(url)
    loc = Location.parse(url)
    assert (loc.scheme, loc.bucket, loc.prefix) == (scheme, bucket, prefix)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://bucket/p", "unknown scheme 'ftp'"),
        ("s3:///prefix", "no bucket"),
        ("s3://bucket/a/../b", "'..' are not valid"),
        ("s3://bucket/p?versionId=3", "query string"),
        ("s3://bucket/p#x", "query string"),
        ("s3://Bucket_Upper/p", "not a valid name"),
        ("s3://key:secret@bucket/p", "credentials in the URL"),
        ("file://host/p", "not a host"),
        ("s3://bucket/a%0Ab", "control characters"),
        ("s3://bucket/a%7F", "control characters"),
        ("s3://bucket/a\tb", "control characters"),
        ("s3:/bucket/p", "needs '//'"),
        ("S3:bucket", "needs '//'"),
        ("gs:/bucket", "needs '//'"),
    ],
)
def test_a_bad_url_is_one_line_naming_what_is_valid(url: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        Location.parse(url)
    message = str(info.value)
    assert says in message and "\n" not in message
    assert "secret" not in message


def test_plain_paths_are_not_urls() -> None:
    assert not is_url("ckpt/s3")
    assert not is_url("/abs/s3:/x")
    assert not is_url(Path("s3://b/p"))
    assert not is_url("s3cache/x") and not is_url("./s3:/x")


def test_a_url_missing_a_slash_is_not_a_relative_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``s3:/bucket/p`` is a typo: an error, not a directory ``s3:`` that the run trains in and
    a new machine never sees."""
    from preemptible import CheckpointStore

    monkeypatch.chdir(tmp_path)
    assert is_url("s3:/bucket/p")
    with pytest.raises(ConfigError, match="needs '//'"):
        CheckpointStore("s3:/bucket/p")
    with pytest.raises(ConfigError, match="needs '//'"):
        checkpoint_directory("s3:/bucket/p")
    assert list(tmp_path.iterdir()) == []


def test_a_url_stays_a_url_for_the_front_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREEMPTIBLE_CHECKPOINT_DIR", raising=False)
    assert checkpoint_directory("s3://ckpt/plain/") == "s3://ckpt/plain"  # canonical
    assert checkpoint_directory("ckpt/plain") == Path("ckpt/plain")


def test_staging_is_named_after_the_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PREEMPTIBLE_STAGING_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert staging_root() == tmp_path / "cache" / "preemptible" / "staging"
    a, b = Location.parse("s3://bucket/a/b"), Location.parse("s3://bucket/a_b")
    assert staging_dir(a).parent == staging_root()
    assert staging_dir(a).name.startswith("s3-bucket-a_b-")
    assert staging_dir(a) != staging_dir(b)
    monkeypatch.setenv("PREEMPTIBLE_STAGING_DIR", str(tmp_path / "st"))
    assert staging_dir(a).parent == tmp_path / "st"


@pytest.mark.parametrize("name", ["my_container", "a.b.c", "double--dash", "x" * 64])
def test_an_azure_container_name_azure_refuses_is_one_line_at_parse(name: str) -> None:
    """Azure's container names are narrower than buckets' (3 to 63 lower-case letters, digits
    and single dashes): caught here, not as a 400 with an XML body at the first request."""
    with pytest.raises(ConfigError) as info:
        Location.parse(f"az://{name}/p")
    message = str(info.value)
    assert f"{name!r} is not a valid name: an Azure container name is 3 to 63" in message
    assert "\n" not in message
    assert Location.parse("az://ok-name-1/p").bucket == "ok-name-1"
    assert Location.parse("s3://a.b.c/p").bucket == "a.b.c"  # S3 and GCS take what they take


S3_RULE = (
    "an S3 bucket name is 3 to 63 lower-case letters, digits, dots and hyphens, starting and "
    "ending with a letter or digit"
)
GCS_RULE = (
    "a GCS bucket name is 3 to 63 lower-case letters, digits, hyphens, underscores and dots "
    "(up to 222 with dots, each dot-separated part at most 63), starting and ending with a "
    "letter or digit"
)


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("s3://hf/run", S3_RULE),  # too short
        ("s3://My_Bucket/x", S3_RULE),
        ("s3://my_bucket/x", S3_RULE),  # GCS takes underscores, S3 does not
        ("s3://" + "a" * 64 + "/x", S3_RULE),
        ("s3://-bucket/x", S3_RULE),
        ("gs://My_Bucket/x", GCS_RULE),
        ("gs://" + "a" * 64 + "/x", GCS_RULE),  # 64 without a dot
        ("gs://a." + "b" * 64 + "/x", GCS_RULE),  # a dot-separated part over 63
        ("gs://bucket_/x", GCS_RULE),
    ],
)
def test_a_bad_bucket_name_states_its_own_clouds_rule_and_the_url_as_typed(
    url: str, rule: str
) -> None:
    with pytest.raises(ConfigError) as info:
        Location.parse(url)
    bucket = url.split("://")[1].split("/")[0]
    assert str(info.value) == f"checkpoint location {url}: {bucket!r} is not a valid name: {rule}"


@pytest.mark.parametrize(
    "url",
    [
        "s3://my.bucket-1/x",
        "s3://abc",
        "s3://" + "a" * 63,
        "gs://my_bucket-1/x",
        "gs://" + "a" * 63,
        "gs://" + ".".join(["b" * 63] * 3) + "/x",  # 191 with dots
    ],
)
def test_a_name_its_cloud_takes_is_valid(url: str) -> None:
    assert Location.parse(url).bucket == url.split("://")[1].split("/")[0]


@pytest.mark.parametrize("below", ["", "sub"])
def test_a_staging_directory_that_is_a_file_names_the_variable(
    below: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It said ``.../afile/s3-... cannot be created: Not a directory`` (or ``File exists``),
    naming neither the variable nor the file in the way."""
    from preemptible import CheckpointStore

    afile = tmp_path / "afile"
    afile.write_text("")
    staging = afile / below if below else afile
    monkeypatch.setenv("PREEMPTIBLE_STAGING_DIR", str(staging))
    with pytest.raises(ConfigError) as info:
        CheckpointStore("s3://bucket/run")  # refused before any request or mkdir
    line = str(info.value)
    assert line.startswith("PREEMPTIBLE_STAGING_DIR: "), line
    assert f"{afile} is a file, not a directory" in line and "\n" not in line
    assert "set PREEMPTIBLE_STAGING_DIR to a directory" in line
    assert afile.read_text() == ""


def test_a_directory_another_process_makes_meanwhile_is_never_called_a_file(
    tmp_path: Path,
) -> None:
    """Two ranks open one checkpoint directory at once: one makes it while the other looks.
    The look never says "is not a directory" of a directory (it once did: the fresh-clone CI
    of stop 40 failed a torchrun test with it)."""
    target = tmp_path / "ckpt"
    toggler = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            "end = time.monotonic() + 20\n"
            "while time.monotonic() < end:\n"
            "    os.mkdir(sys.argv[1]); os.rmdir(sys.argv[1])\n",
            str(target),
        ]
    )
    try:
        said = set()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and toggler.poll() is None:
            said.add(not_a_directory(target))
        assert said == {None}
    finally:
        toggler.kill()
        toggler.wait(timeout=10)
