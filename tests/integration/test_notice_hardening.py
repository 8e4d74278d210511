"""Platform notices end to end, against what goes wrong: a metadata server that drips its
answer (``preemptible doctor`` must still finish), credentials in an endpoint (never printed),
and a stop file that cannot be removed (one stop, then the resumed run finishes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import attempts, supervise
from tests.support.env import CLEAN
from tests.support.files import touch_later, unremovable
from tests.support.metadata import MetadataServer

pytestmark = pytest.mark.timeout(120)
SECRET = "s3cr3t-Pa55"
# the platform's config with a save_fn that writes a marker: no torch import, a fast test
TRAINER = """
import dataclasses, sys, time, preemptible
from preemptible.notices import default_config
sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line
config = dataclasses.replace(default_config(), save_fn=lambda path: path.write_text("x"))
handler = preemptible.PreemptionCheckpointHandler(sys.argv[1], termination_config=config)
print("resumed", handler.resume(), flush=True)
for step in handler.steps(int(sys.argv[2])):
    print("step", step, flush=True)
    time.sleep(0.02)
print("done", flush=True)
"""


def test_doctor_finishes_against_a_dripping_server_and_hides_credentials(
    metadata_server: MetadataServer,
) -> None:
    metadata_server.state.fault["gce"] = "drip-headers"
    metadata_server.state.drip_seconds = 0.1  # each byte well within any per-read timeout
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "preemptible", "doctor", "--json"],
        env={
            **os.environ,
            **CLEAN,
            "GCE_METADATA_HOST": f"http://u:{SECRET}@{metadata_server.host}",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - started < 20
    checks = {c["name"]: c for c in json.loads(out.stdout)}
    gce = checks["notices (gce)"]
    assert gce["status"] == "warn" and "did not answer" in gce["detail"], gce
    assert f"{metadata_server.url}/computeMetadata/v1/instance/" in gce["detail"]
    assert "no complete answer within 1 s" in gce["detail"]
    assert SECRET not in out.stdout + out.stderr


def test_a_stop_file_that_cannot_be_removed_stops_one_attempt_only(tmp_path: Path, spawn) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    folder = tmp_path / "ro"
    folder.mkdir()
    stop = folder / "STOP"
    stop.touch()  # a stop request left over from an earlier attempt that could not remove it
    env = {
        **CLEAN,
        "PREEMPTIBLE_PLATFORM": "local",
        "PREEMPTIBLE_STOP_FILE": str(stop),
        "PREEMPTIBLE_POLL_INTERVAL": "0.05",
    }
    with unremovable(folder):
        sup = supervise(
            spawn,
            tmp_path,
            "--max-preemptions",
            "2",
            "--",
            sys.executable,
            str(script),
            str(tmp_path / "ck"),
            "100",
            env=env,
        )
        sup.wait_line(lambda line: line == "step 5", timeout=60)
        touch_later(stop)  # a new request: this attempt stops, the resumed one goes on
        assert sup.wait(60) == 0, sup.output
    assert stop.exists()
    assert [a["state"] for a in attempts(tmp_path)] == ["PREEMPTED", "FINISHED"], sup.output
    assert "cannot be removed" in sup.output and "touch it again" in sup.output
    resumed = [line for line in sup.lines if line.startswith("resumed ")]
    assert resumed[0] == "resumed 0" and int(resumed[1].split()[1]) > 5, sup.output
