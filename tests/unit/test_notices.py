"""Platform detection and each notice source against a metadata server on 127.0.0.1."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from preemptible import ConfigError, NoticeError, detect_platform
from preemptible.notices import default_config, detect
from preemptible.notices._sources import EC2, GCE, Azure, Composite, StopFile
from tests.support.metadata import MetadataServer

pytestmark = pytest.mark.usefixtures("clean_platform_env")


def dmi(tmp_path: Path, **files: str) -> None:
    (tmp_path / "dmi").mkdir(exist_ok=True)
    for name, text in files.items():
        (tmp_path / "dmi" / name).write_text(text + "\n")


@pytest.mark.parametrize(
    ("env", "files", "platform"),
    [
        ({}, {}, "local"),
        ({"SLURM_JOB_ID": "12"}, {}, "slurm"),
        (
            {"KUBERNETES_SERVICE_HOST": "10.0.0.1"},
            {"product_name": "Google Compute Engine"},
            "kubernetes",
        ),
        ({}, {"product_name": "Google Compute Engine"}, "gce"),
        ({}, {"sys_vendor": "Amazon EC2"}, "ec2"),
        ({}, {"chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77"}, "azure"),
        ({"GCE_METADATA_HOST": "127.0.0.1:1"}, {}, "gce"),
        ({"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:1"}, {}, "ec2"),
        ({"PREEMPTIBLE_AZURE_METADATA_ENDPOINT": "http://127.0.0.1:1"}, {}, "azure"),
        ({"PREEMPTIBLE_PLATFORM": "local", "SLURM_JOB_ID": "3"}, {}, "local"),
    ],
)
def test_detect_platform(
    env: dict[str, str],
    files: dict[str, str],
    platform: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    dmi(tmp_path, **files)
    assert detect_platform() == platform
    assert detect().reason


def test_forced_platform_must_be_known(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREEMPTIBLE_PLATFORM", "mainframe")
    with pytest.raises(ConfigError, match="use one of slurm, gce, ec2, azure, kubernetes, local"):
        detect_platform()


def test_default_configs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert default_config("local").termination_watcher_fn is None
    assert default_config("kubernetes").grace_period == 25.0  # 30 s window - 5 s to exit
    monkeypatch.setenv("PREEMPTIBLE_GRACE_PERIOD", "90")
    assert default_config("kubernetes").grace_period == 85.0
    monkeypatch.setenv("PREEMPTIBLE_STOP_FILE", str(tmp_path / "stop"))
    assert default_config("local").termination_watcher_fn is not None
    monkeypatch.setenv("PREEMPTIBLE_GRACE_PERIOD", "soon")
    with pytest.raises(ConfigError, match="PREEMPTIBLE_GRACE_PERIOD='soon' is not valid"):
        default_config("local")


def test_gce_spot_and_maintenance(metadata_server: MetadataServer) -> None:
    gce = GCE(metadata_server.host)
    assert gce.poll() is None
    metadata_server.state.gce_maintenance = "MIGRATE_ON_HOST_MAINTENANCE"
    assert gce.poll() is None, "a live migration is not a stop"
    metadata_server.state.gce_maintenance = "TERMINATE_ON_HOST_MAINTENANCE"
    n = gce.poll()
    assert n is not None and n.source == "gce" and "maintenance" in n.detail
    metadata_server.state.gce_maintenance = "NONE"
    metadata_server.state.gce_preempted = "TRUE"
    n = gce.poll()
    assert n is not None and "Spot" in n.detail
    assert n.deadline is not None and 25 < n.deadline - time.time() <= 30


def test_gce_notice_counts_its_window_from_the_last_poll_that_saw_nothing(
    metadata_server: MetadataServer,
) -> None:
    gce = GCE(metadata_server.host)
    assert gce.poll() is None
    clear = time.time()
    metadata_server.state.gce_preempted = "TRUE"
    threading.Event().wait(0.3)  # the gap between two polls, under test
    n = gce.poll()
    assert n is not None and n.deadline is not None
    assert 0.25 < n.detection_latency < 0.3 + (time.time() - clear)
    fresh = GCE(metadata_server.host).poll()  # no poll saw "FALSE": the notice may be a window old
    assert fresh is not None and fresh.detection_latency == 30.0  # so: stop at once


def test_ec2_spot_interruption_and_rebalance(metadata_server: MetadataServer) -> None:
    ec2 = EC2(metadata_server.url)
    assert ec2.poll() is None
    metadata_server.state.ec2_rebalance = {"noticeTime": "2026-11-29T10:00:00Z"}
    warning = ec2.poll()
    assert warning is not None and warning.stop is False and warning.source == "ec2-rebalance"
    assert ec2.poll() is None, "the rebalance warning is given once"
    metadata_server.state.ec2_interrupt(in_seconds=120)
    n = ec2.poll()
    assert n is not None and n.stop and n.deadline is not None
    assert 115 < n.deadline - time.time() <= 121
    puts = [r for r in metadata_server.state.requests if r[0] == "PUT"]
    assert len(puts) == 1, "the IMDSv2 token is reused until it expires"


def test_ec2_token_expiry_gets_a_new_token(metadata_server: MetadataServer) -> None:
    ec2 = EC2(metadata_server.url)
    assert ec2.poll() is None
    metadata_server.state.expire_tokens()
    metadata_server.state.ec2_interrupt(in_seconds=60)
    assert ec2.poll() is not None
    assert len([r for r in metadata_server.state.requests if r[0] == "PUT"]) == 2


def test_azure_preempt_with_deadline_and_acknowledgement(metadata_server: MetadataServer) -> None:
    azure = Azure(metadata_server.url)
    assert azure.poll() is None
    metadata_server.state.azure_events.append(
        {"EventId": "f", "EventType": "Freeze", "NotBefore": ""}
    )
    assert azure.poll() is None, "a freeze is not a stop"
    event_id = metadata_server.state.azure_event("Preempt", not_before_in=30)
    n = azure.poll()
    assert n is not None and n.deadline is not None and 28 < n.deadline - time.time() <= 31
    assert n.acknowledge is not None
    n.acknowledge()
    assert metadata_server.state.azure_acks == [event_id]


@pytest.mark.parametrize("fault", ["500", "404", "garbage", "slow"])
@pytest.mark.parametrize("kind", ["gce", "ec2", "azure"])
def test_bad_servers_raise_quickly(kind: str, fault: str, metadata_server: MetadataServer) -> None:
    metadata_server.state.fault[kind] = fault
    metadata_server.state.slow_seconds = 1.0
    source = {
        "gce": lambda: GCE(metadata_server.host, timeout=0.5),
        "ec2": lambda: EC2(metadata_server.url, timeout=0.5),
        "azure": lambda: Azure(metadata_server.url, timeout=0.5),
    }[kind]()
    started = time.monotonic()
    with pytest.raises((NoticeError, OSError)):
        source.poll()
    assert time.monotonic() - started < 2.0, "a slow server must not hold the watcher"


def test_unreachable_server_raises_oserror() -> None:
    with pytest.raises(OSError):
        GCE("127.0.0.1:9", timeout=0.5).poll()  # the discard port: nothing listens


def test_composite_logs_each_failing_source_once(
    metadata_server: MetadataServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    metadata_server.state.fault["gce"] = "500"
    stop = tmp_path / "stop"
    watcher = Composite([GCE(metadata_server.host), StopFile(stop)])
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        assert watcher() is None
        assert watcher() is None
        stop.touch()
        n = watcher()
    assert n is not None and n.source == "stop-file"
    assert not stop.exists(), "the stop file is taken, so the resumed run goes on"
    assert caplog.text.count("gce notices unavailable") == 1


@pytest.mark.parametrize("kind", ["gce", "ec2", "azure"])
def test_watcher_thread_sees_a_notice_within_one_poll(
    kind: str, metadata_server: MetadataServer
) -> None:
    from preemptible.stop._termination import Notice, Watcher
    from tests.conftest import wait_for

    source = {
        "gce": lambda: GCE(metadata_server.host),
        "ec2": lambda: EC2(metadata_server.url),
        "azure": lambda: Azure(metadata_server.url),
    }[kind]()
    seen: list[tuple[float, Notice]] = []
    interval = 0.5
    watcher = Watcher(
        Composite([source]),
        lambda n: seen.append((time.monotonic(), n)),
        interval=interval,
        name=kind,
    )
    watcher.start()
    try:
        wait_for(lambda: len(metadata_server.state.requests) >= 2, 10, "the first polls")
        flipped = time.monotonic()
        if kind == "gce":
            metadata_server.state.gce_preempted = "TRUE"
        elif kind == "ec2":
            metadata_server.state.ec2_interrupt(in_seconds=120)
        else:
            metadata_server.state.azure_event("Preempt", not_before_in=30)
        wait_for(lambda: seen, 5, "the notice")
    finally:
        watcher.stop()
    # one poll (<= 0.5 s) plus room for a loaded machine; two polls would be >= 1 s
    assert seen[0][0] - flipped <= interval + 0.4, "seen later than one poll interval"
    assert seen[0][1].stop
