"""Metadata requests against hostile servers on 127.0.0.1 (redirects, dripping answers),
credentials in endpoint URLs, and environment values checked where they are read."""

from __future__ import annotations

import base64
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from preemptible import ConfigError, NoticeError
from preemptible.notices import default_config, detect, grace_period_from_env, sources_for
from preemptible.notices._sources import EC2, GCE, Azure, Composite, Source, StopFile
from tests.support.files import touch_later, unremovable
from tests.support.metadata import MetadataServer

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("clean_platform_env")]

ENDPOINT_VARS = {
    "gce": "GCE_METADATA_HOST",
    "ec2": "AWS_EC2_METADATA_SERVICE_ENDPOINT",
    "azure": "PREEMPTIBLE_AZURE_METADATA_ENDPOINT",
}
SECRET = "s3cr3t-Pa55"
DEADLINE = 0.5
MARGIN = 1.5  # room for a loaded machine; a dripping request held to its end takes minutes


@pytest.fixture
def target() -> Iterator[MetadataServer]:
    """A second server: where a redirect points. It must never hear from the watcher."""
    with MetadataServer() as s:
        yield s


def make(kind: str, endpoint: str, timeout: float = 2.0) -> GCE | EC2 | Azure:
    cls: Callable[..., GCE | EC2 | Azure] = {"gce": GCE, "ec2": EC2, "azure": Azure}[kind]
    return cls(endpoint, timeout=timeout)


# --- 1. redirects are never followed


@pytest.mark.parametrize("kind", ["gce", "ec2", "azure"])
def test_a_redirect_is_a_bad_answer_and_its_target_never_hears_from_us(
    kind: str, metadata_server: MetadataServer, target: MetadataServer
) -> None:
    # the target would announce a stop: taking its answer would be a false preemption
    target.state.gce_preempted = "TRUE"
    target.state.ec2_interrupt(in_seconds=120)
    target.state.azure_event("Preempt", not_before_in=30)
    metadata_server.state.fault[kind] = "redirect"
    metadata_server.state.redirect_to = target.url
    with pytest.raises(NoticeError, match="302 redirect refused"):
        make(kind, metadata_server.url).poll()
    assert target.state.requests == [], "the redirect's Location was contacted"
    assert metadata_server.state.requests, "the configured metadata_server was asked"
    if kind == "ec2":  # the token was in play: the GET that was redirected carried it
        assert metadata_server.state.requests[-1][0] == "GET"
        assert "X-aws-ec2-metadata-token" in metadata_server.state.headers[-1]


@pytest.mark.parametrize("kind", ["gce", "ec2", "azure"])
def test_proxy_variables_are_ignored(
    kind: str,
    metadata_server: MetadataServer,
    target: MetadataServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.setenv(var, target.url)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert make(kind, metadata_server.url).poll() is None
    assert metadata_server.state.requests and target.state.requests == []


def test_gce_preempted_counts_only_as_a_200_true(metadata_server: MetadataServer) -> None:
    gce = GCE(metadata_server.host)
    for answer in ("MAYBE", "true", ""):
        metadata_server.state.gce_preempted = answer
        with pytest.raises(NoticeError, match="not TRUE/FALSE"):
            gce.poll()
    metadata_server.state.gce_preempted = "TRUE"
    metadata_server.state.fault["gce"] = "404"
    with pytest.raises(NoticeError, match="HTTP 404"):
        gce.poll()


# --- 2. a total deadline per request


@pytest.mark.parametrize("drip", ["drip-headers", "drip-body"])
@pytest.mark.parametrize("kind", ["gce", "ec2", "azure"])
def test_a_dripping_server_times_out_at_the_deadline(
    kind: str, drip: str, metadata_server: MetadataServer
) -> None:
    metadata_server.state.fault[kind] = drip
    metadata_server.state.drip_seconds = (
        0.05  # far below the deadline: a per-read timeout never fires
    )
    source = make(kind, metadata_server.url, timeout=DEADLINE)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as caught:
        source.poll()
    took = time.monotonic() - started
    assert took < DEADLINE + MARGIN, f"held {took:.2f} s by a dripping server"
    assert metadata_server.url in str(caught.value) and f"within {DEADLINE:g} s" in str(
        caught.value
    )


def test_the_azure_acknowledgement_has_a_deadline(metadata_server: MetadataServer) -> None:
    event = metadata_server.state.azure_event("Preempt", not_before_in=30)
    notice = Azure(metadata_server.url, timeout=DEADLINE).poll()
    assert notice is not None and notice.acknowledge is not None
    metadata_server.state.fault["azure"] = "drip-headers"
    metadata_server.state.drip_seconds = 0.05
    started = time.monotonic()
    with pytest.raises(TimeoutError) as caught:
        notice.acknowledge()
    assert str(caught.value).startswith(f"POST {metadata_server.url}/metadata/scheduledevents")
    assert time.monotonic() - started < DEADLINE + MARGIN
    assert ("POST", Azure.PATH) in metadata_server.state.requests
    assert metadata_server.state.azure_acks == [], "the dripping metadata_server never took the ack"
    metadata_server.state.fault.clear()
    notice.acknowledge()
    assert metadata_server.state.azure_acks == [event]


def test_the_watcher_goes_on_past_a_dripping_server(
    metadata_server: MetadataServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    metadata_server.state.fault["gce"] = "drip-body"
    metadata_server.state.drip_seconds = 0.05
    stop = tmp_path / "stop"
    watcher = Composite([GCE(metadata_server.host, timeout=0.5), StopFile(stop)])
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        assert watcher() is None
        stop.touch()
        started = time.monotonic()
        notice = watcher()
    assert notice is not None and notice.source == "stop-file"
    assert time.monotonic() - started < 0.5 + MARGIN
    assert caplog.text.count("gce notices unavailable") == 1
    assert "TimeoutError" in caplog.text and "within 0.5 s" in caplog.text


# --- 3. credentials in an endpoint are sent to that host only, and never shown


def _secret_url(metadata_server: MetadataServer) -> str:
    return f"http://metadata-user:{SECRET}@{metadata_server.host}"


@pytest.mark.parametrize("kind", ["gce", "ec2", "azure"])
def test_credentials_are_used_but_never_shown(
    kind: str,
    metadata_server: MetadataServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv(ENDPOINT_VARS[kind], _secret_url(metadata_server))
    [source] = sources_for(kind)
    # what `preemptible doctor` shows (base or url), then the display form of every message
    shown = [getattr(source, a, "") for a in ("base", "url", "display")]
    assert all(metadata_server.host in s and SECRET not in s for s in shown if s), shown

    assert source.poll() is None
    basic = "Basic " + base64.b64encode(f"metadata-user:{SECRET}".encode()).decode()
    assert all(h.get("Authorization") == basic for h in metadata_server.state.headers)

    errors: list[BaseException] = []
    for fault in ("500", "garbage", "redirect", "drip-headers"):
        metadata_server.state.fault[kind] = fault
        metadata_server.state.redirect_to = f"http://other:{SECRET}@127.0.0.1:9"
        metadata_server.state.drip_seconds = 0.05
        source.timeout = 0.3
        with pytest.raises((NoticeError, OSError)) as caught:
            source.poll()
        errors.append(caught.value)
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        Composite([source])()
    unreachable = make(kind, f"http://u:{SECRET}@127.0.0.1:9", timeout=0.3)
    with pytest.raises(OSError) as refused:
        unreachable.poll()  # the discard port: nothing listens
    errors.append(refused.value)
    assert "notices unavailable" in caplog.text
    for text in [caplog.text, *map(str, errors), *map(repr, errors)]:
        assert SECRET not in text, text


def test_a_bad_endpoint_with_credentials_is_refused_without_showing_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GCE_METADATA_HOST", f"ftp://u:{SECRET}@host")
    with pytest.raises(ConfigError) as caught:
        default_config("gce")
    assert "GCE_METADATA_HOST='ftp://***@host' is not valid" in str(caught.value)
    assert SECRET not in str(caught.value)


# --- 4. environment values


@pytest.mark.parametrize("kind", ["gce", "ec2", "azure"])
@pytest.mark.parametrize(
    "value",
    [
        "ftp://169.254.169.254",
        "file:///etc/passwd",
        "http://",
        "http://:80",
        "metadata host",
        " 169.254.169.254",
        "http://host:abc",
        "http://host:70000",
        "http://[::1",
        "host/computeMetadata",
        "http://host/?x=1",
    ],
)
def test_bad_endpoint_values_are_refused_in_one_line(
    kind: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    var = ENDPOINT_VARS[kind]
    monkeypatch.setenv(var, value)
    assert detect().platform == kind
    with pytest.raises(ConfigError) as caught:
        default_config()
    message = str(caught.value)
    assert message.startswith(f"{var}={value!r} is not valid")
    assert "host[:port] or an http(s):// URL" in message and "\n" not in message


@pytest.mark.parametrize(
    ("value", "base"),
    [
        ("169.254.169.254", "http://169.254.169.254"),
        ("metadata.google.internal:8080", "http://metadata.google.internal:8080"),
        ("http://[fd00:ec2::254]", "http://[fd00:ec2::254]"),
        ("HTTPS://example.internal:8443/", "https://example.internal:8443"),
        ("http://127.0.0.1:1/prefix/", "http://127.0.0.1:1/prefix"),
    ],
)
def test_good_endpoint_values(value: str, base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", value)
    [source] = sources_for("ec2")
    assert isinstance(source, EC2) and source.base == base == source.display


def test_gce_notice_seconds_is_checked_when_the_source_is_made(
    monkeypatch: pytest.MonkeyPatch, metadata_server: MetadataServer
) -> None:
    monkeypatch.setenv("GCE_METADATA_HOST", metadata_server.host)
    monkeypatch.setenv("PREEMPTIBLE_GCE_NOTICE_SECONDS", "abc")
    with pytest.raises(ConfigError, match="PREEMPTIBLE_GCE_NOTICE_SECONDS='abc' is not valid"):
        default_config("gce")
    monkeypatch.setenv("PREEMPTIBLE_GCE_NOTICE_SECONDS", "12")
    metadata_server.state.gce_preempted = "TRUE"
    [gce] = sources_for("gce")
    notice = gce.poll()
    assert notice is not None and notice.deadline is not None
    assert 10 < notice.deadline - time.time() <= 12


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf"])
def test_poll_interval_must_be_positive_seconds(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREEMPTIBLE_POLL_INTERVAL", value)
    with pytest.raises(
        ConfigError, match=rf"PREEMPTIBLE_POLL_INTERVAL='{value}' is not valid.*> 0"
    ):
        default_config("local")


def test_poll_interval_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREEMPTIBLE_POLL_INTERVAL", "0.25")
    assert default_config("local").poll_interval == 0.25


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "soon"])
def test_grace_period_must_be_finite_seconds(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from preemptible.supervisor import term_timeout

    monkeypatch.setenv("PREEMPTIBLE_GRACE_PERIOD", value)
    with pytest.raises(ConfigError, match=rf"PREEMPTIBLE_GRACE_PERIOD='{value}' is not valid"):
        grace_period_from_env()
    seconds, where = term_timeout()  # the doctor asks it: it goes on without the variable ...
    assert math.isfinite(seconds) and "GRACE_PERIOD" not in where  # ... and still escalates


def test_platform_and_dmi_dir_through_the_env_readers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PREEMPTIBLE_PLATFORM", "")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert detect().platform == "slurm", "an empty PREEMPTIBLE_PLATFORM is not set"
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("PREEMPTIBLE_PLATFORM", "gcp")
    with pytest.raises(ConfigError, match="PREEMPTIBLE_PLATFORM='gcp' is not valid; use one of"):
        detect()
    monkeypatch.delenv("PREEMPTIBLE_PLATFORM")
    (tmp_path / "dmi").mkdir()
    (tmp_path / "dmi" / "sys_vendor").write_text("Amazon EC2\n")
    assert detect().platform == "ec2"


# --- 5. the stop file


def test_a_directory_as_stop_file_is_refused_at_config_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PREEMPTIBLE_STOP_FILE", str(tmp_path))
    with pytest.raises(ConfigError) as caught:
        default_config("local")
    assert str(caught.value).startswith(f"PREEMPTIBLE_STOP_FILE={str(tmp_path)!r} is not valid")
    assert "a directory" in str(caught.value)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv("PREEMPTIBLE_STOP_FILE", str(fifo))
    with pytest.raises(ConfigError, match="not a regular file"):
        default_config("local")


def test_a_directory_appearing_later_is_a_bad_answer_not_a_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stop = tmp_path / "STOP"
    watcher = Composite([StopFile(stop)])
    stop.mkdir()
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        assert watcher() is None
        assert watcher() is None
    assert stop.is_dir(), "left alone"
    assert caplog.text.count("stop-file notices unavailable") == 1
    assert "is a directory, not a file" in caplog.text
    stop.rmdir()
    stop.touch()
    notice = watcher()
    assert notice is not None and notice.source == "stop-file" and not stop.exists()


def test_a_symlink_to_a_file_is_a_stop_and_only_the_link_goes(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.touch()
    stop = tmp_path / "STOP"
    source = StopFile(stop)
    stop.symlink_to(real)
    assert source.poll() is not None
    assert not stop.is_symlink() and real.exists()
    stop.symlink_to(tmp_path / "missing")
    assert source.poll() is None, "a dangling link is no stop request"


def test_a_stop_file_that_cannot_be_removed_stops_once_per_touch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    stop = folder / "STOP"
    first_run: Source = StopFile(stop)
    stop.touch()
    with unremovable(folder), caplog.at_level(logging.WARNING, logger="preemptible"):
        notice = first_run.poll()
        assert notice is not None and stop.exists(), "the stop is taken though the file stays"
        assert first_run.poll() is None, "and taken once"
        assert "cannot be removed" in caplog.text

        resumed: Source = StopFile(stop)  # the next attempt finds the same file
        assert resumed.poll() is None and resumed.poll() is None
        assert caplog.text.count("ignoring") == 1, "logged once"

        touch_later(stop)  # a new request
        assert resumed.poll() is not None
        assert resumed.poll() is None
        assert StopFile(stop).poll() is None
