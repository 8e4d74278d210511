"""Each platform, end to end: a notice -> committed checkpoint(s) -> exit code -> run state.

The cloud metadata services are served from 127.0.0.1 (tests/support/metadata.py) and found by
the trainer through each platform's override variable; Kubernetes is a SIGTERM with a grace
window; the stop file is a file. ``preemptible run`` supervises and classifies.
"""

from __future__ import annotations

import email.utils
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Child, attempts, python_args, supervise, wait_for
from tests.support.env import CLEAN
from tests.support.metadata import MetadataServer

pytestmark = pytest.mark.timeout(120)
# seconds of notice each fake platform gives: the trainer needs ~1.6 s of it for its last
# steps, its save and its exit (more on a loaded machine), so 0.4 x WINDOW leaves room
WINDOW = 6.0


def trainer(tmp_path: Path) -> list[str]:
    return python_args(
        "train.py",
        "--ckpt",
        str(tmp_path / "ck"),
        "--out",
        str(tmp_path / "o.pt"),
        "--steps",
        "100000",
        "--step-sleep",
        "0.05",
        "--keep",
        "10",
    )


def checkpoints(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "ck").glob("step-*.ckpt"))


def notice_run(
    spawn, tmp_path: Path, env: dict[str, str], trigger: Callable[[Child], None], *sup_args: str
) -> tuple[Child, float]:
    env = {"PREEMPTIBLE_POLL_INTERVAL": "0.2", **env}
    sup = supervise(
        spawn, tmp_path, "--max-preemptions", "0", *sup_args, "--", *trainer(tmp_path), env=env
    )
    sup.wait_line(lambda line: line == "step 3", timeout=60)
    noticed = time.time()
    trigger(sup)
    assert sup.wait(60) == 143, sup.output
    return sup, noticed


def assert_used_the_window(
    tmp_path: Path, noticed: float, sup: Child, window: float = WINDOW
) -> None:
    saved = checkpoints(tmp_path)
    assert len(saved) == 2, f"insurance + final checkpoint expected, got {saved}\n{sup.output}"
    first, final = (int(p.name[5:15]) for p in saved)
    assert final - first >= 10, "training should go on after the insurance checkpoint"
    committed = saved[1].stat().st_mtime - noticed
    assert 0.4 * window < committed < window, (
        f"final checkpoint {committed:.2f} s after notice, window {window:.2f} s"
    )
    [a] = attempts(tmp_path)
    assert a["state"] == "PREEMPTED", sup.output


def test_gce_spot_preemption(metadata_server: MetadataServer, tmp_path: Path, spawn) -> None:
    env = {"GCE_METADATA_HOST": metadata_server.host, "PREEMPTIBLE_GCE_NOTICE_SECONDS": str(WINDOW)}

    def preempt(_: Child) -> None:
        metadata_server.state.gce_preempted = "TRUE"

    sup, noticed = notice_run(spawn, tmp_path, env, preempt)
    assert "GCE preempted this Spot/preemptible VM" in sup.output
    assert_used_the_window(tmp_path, noticed, sup)


def test_ec2_spot_interruption_after_a_rebalance_warning(
    metadata_server: MetadataServer, tmp_path: Path, spawn
) -> None:
    env = {"AWS_EC2_METADATA_SERVICE_ENDPOINT": metadata_server.url}

    def interrupt(sup: Child) -> None:
        metadata_server.state.ec2_rebalance = {"noticeTime": "2026-11-29T10:00:00Z"}
        sup.wait_line(lambda line: "rebalance" in line, timeout=10)
        # the watcher logs before the loop saves: let the rebalance save land first, or both
        # notices may meet at one step boundary and share one insurance save
        wait_for(lambda: len(checkpoints(tmp_path)) == 1, 30, "the rebalance insurance save")
        metadata_server.state.ec2_interrupt(in_seconds=WINDOW + 1)  # EC2 times have 1 s resolution

    sup, _ = notice_run(spawn, tmp_path, env, interrupt)
    assert "EC2 Spot interruption: terminate" in sup.output
    # one insurance save for the rebalance warning, one for the notice, one final
    assert len(checkpoints(tmp_path)) == 3, sup.output
    [a] = attempts(tmp_path)
    assert a["state"] == "PREEMPTED"


def test_azure_preempt_event_is_acknowledged_after_the_checkpoint(
    metadata_server: MetadataServer, tmp_path: Path, spawn
) -> None:
    env = {"PREEMPTIBLE_AZURE_METADATA_ENDPOINT": metadata_server.url}
    events: list[str] = []
    not_befores: list[str] = []

    def preempt(_: Child) -> None:
        events.append(metadata_server.state.azure_event("Preempt", not_before_in=WINDOW))
        not_befores.append(metadata_server.state.azure_events[-1]["NotBefore"])

    sup, noticed = notice_run(spawn, tmp_path, env, preempt)
    # NotBefore has whole seconds: the window the trainer was given is up to 1 s short
    not_before = email.utils.parsedate_to_datetime(not_befores[0]).timestamp()
    assert_used_the_window(tmp_path, noticed, sup, window=not_before - noticed)
    assert metadata_server.state.azure_acks == events


def test_kubernetes_sigterm_with_a_grace_period(tmp_path: Path, spawn) -> None:
    # an 11 s pod window: the trainer aims for 11 - 5 = 6 s, the supervisor SIGKILLs at 9 s
    grace = int(WINDOW) + 5
    env = {"PREEMPTIBLE_PLATFORM": "kubernetes", "PREEMPTIBLE_GRACE_PERIOD": str(grace)}
    sup, noticed = notice_run(spawn, tmp_path, env, lambda s: s.signal(signal.SIGTERM))
    assert f"SIGKILL in {grace - 2} s" in sup.output
    assert_used_the_window(tmp_path, noticed, sup)


def test_stop_file(tmp_path: Path, spawn) -> None:
    stop = tmp_path / "STOP"
    notice_run(spawn, tmp_path, {"PREEMPTIBLE_STOP_FILE": str(stop)}, lambda s: stop.touch())
    assert len(checkpoints(tmp_path)) == 1
    assert not stop.exists()
    assert (
        json.loads(
            (
                next((tmp_path / ".preemptible" / "runs").glob("*/attempt-1")) / "record.json"
            ).read_text()
        )["reason"]
        == "stop-file"
    )


def doctor(env: dict[str, str]) -> dict[str, dict[str, str]]:
    out = subprocess.run(
        [sys.executable, "-m", "preemptible", "doctor", "--json"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return {c["name"]: c for c in json.loads(out.stdout)}


def test_doctor_in_each_simulated_platform(metadata_server: MetadataServer, tmp_path: Path) -> None:
    gce = doctor({**CLEAN, "GCE_METADATA_HOST": metadata_server.host})
    assert gce["platform"]["detail"].startswith("gce (GCE_METADATA_HOST is set)")
    assert gce["notices (gce)"]["status"] == "ok" and "reachable" in gce["notices (gce)"]["detail"]

    metadata_server.state.ec2_interrupt(in_seconds=120)
    ec2 = doctor({**CLEAN, "AWS_EC2_METADATA_SERVICE_ENDPOINT": metadata_server.url})
    assert ec2["notices (ec2)"]["status"] == "warn"
    assert "a notice is pending now" in ec2["notices (ec2)"]["detail"]

    metadata_server.state.fault["azure"] = "500"
    azure = doctor({**CLEAN, "PREEMPTIBLE_AZURE_METADATA_ENDPOINT": metadata_server.url})
    assert azure["notices (azure)"]["status"] == "warn"
    assert "did not answer" in azure["notices (azure)"]["detail"]
    assert "reachable" in azure["notices (azure)"]["fix"]

    k8s = doctor({**CLEAN, "KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    assert k8s["platform"]["detail"].startswith("kubernetes")
    assert k8s["notices (kubernetes)"]["status"] == "warn"
    assert "PREEMPTIBLE_GRACE_PERIOD" in k8s["notices (kubernetes)"]["fix"]
    assert "window after SIGTERM" in k8s["on preemption"]["detail"]
    k8s = doctor({**CLEAN, "KUBERNETES_SERVICE_HOST": "10.0.0.1", "PREEMPTIBLE_GRACE_PERIOD": "90"})
    assert k8s["notices (kubernetes)"]["status"] == "ok"
    assert "88 s after the first stop signal" in k8s["term-timeout"]["detail"]

    local = doctor({**CLEAN, "PREEMPTIBLE_DMI_DIR": str(tmp_path), "WORLD_SIZE": "2"})
    assert local["platform"]["detail"].startswith("local")
    assert "USR2" in local["nccl"]["fix"]

    bad = subprocess.run(
        [sys.executable, "-m", "preemptible", "doctor"],
        env={**os.environ, **CLEAN, "PREEMPTIBLE_PLATFORM": "vax"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "WARN platform" in bad.stdout and "'vax' is not valid" in bad.stdout
