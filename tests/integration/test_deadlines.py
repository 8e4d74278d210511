"""Deadlines include the way out: with a notice that carries a deadline, the process is *gone*
before it, not only checkpointed, and the checkpoint resumes bit for bit.

A plain training loop (tests/scripts/train.py: ~0.15 s steps, saves of 0.5 s) gets a notice
from the fake metadata services (tests/support/metadata.py) with a deadline 4-5 s away: EC2's
spot/instance-action time, Azure's Preempt NotBefore, and GCE's window scaled from 30 s to 5 s
with PREEMPTIBLE_GCE_NOTICE_SECONDS (the policy's arithmetic is the same; 30 s real seconds
would make the test 30 s long). The test measures when the process is gone (its own waitpid)
against the deadline the platform gave.

Under ``preemptible run``, the exit time an attempt took (from its final commit to its last
process reaped) is budgeted for the next one: an exit three times longer than the default
budget still ends before the deadline.
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
from datetime import datetime
from pathlib import Path

import pytest
import torch

from tests.conftest import Child, attempts, python_args, read_pid, supervise
from tests.support.env import CLEAN
from tests.support.metadata import MetadataServer

pytestmark = pytest.mark.timeout(90)
STEPS = 60


def trainer(tmp_path: Path, *extra: str) -> list[str]:
    return python_args(
        "train.py",
        "--ckpt",
        str(tmp_path / "ck"),
        "--out",
        str(tmp_path / "final.pt"),
        "--steps",
        str(STEPS),
        "--keep",
        "10",
        "--slow-save",
        "0.5",
        *extra,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run without interruption (step and save times do not change the numbers)."""
    d = tmp_path_factory.mktemp("reference")
    child = Child(trainer(d), env=CLEAN)
    try:
        assert child.wait(120) == 0, child.output
    finally:
        child.kill()
    return d / "final.pt"


def checkpoints(tmp_path: Path) -> list[int]:
    return sorted(int(p.name[5:15]) for p in (tmp_path / "ck").glob("step-*.ckpt"))


def ec2_deadline(metadata_server: MetadataServer) -> float:
    assert metadata_server.state.ec2_action is not None
    when = metadata_server.state.ec2_action["time"].replace("Z", "+00:00")
    return datetime.fromisoformat(when).timestamp()


def preempt(
    spawn: Callable[..., Child],
    tmp_path: Path,
    env: dict[str, str],
    notice: Callable[[], float],
) -> tuple[Child, float, float]:
    """Start the trainer, give it a notice at step 3 (``notice`` returns the platform's
    deadline), and return it with the deadline and when the test saw it exit."""
    child = spawn(
        trainer(tmp_path, "--step-sleep", "0.15"),
        env={**CLEAN, "PREEMPTIBLE_POLL_INTERVAL": "0.2", **env},
    )
    child.wait_line(lambda line: line == "step 3", timeout=60)
    deadline = notice()
    assert deadline - time.time() > 3.9, "the notice must leave 4-5 s"
    try:
        child.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running 30 s after the notice:\n{child.output}") from None
    gone = time.time()
    child.wait(10)  # the output, to the end
    return child, deadline, gone


def assert_gone_in_time_and_exact(
    spawn: Callable[..., Child],
    tmp_path: Path,
    reference: Path,
    child: Child,
    deadline: float,
    gone: float,
) -> None:
    assert child.proc.returncode == 143, child.output
    assert gone < deadline, f"exited {gone - deadline:.2f} s after the deadline\n{child.output}"
    saved = checkpoints(tmp_path)
    # the notice came at step 3; how much longer the policy trains depends on the measured
    # step and save times (test_platforms.py checks that a window is used)
    assert saved and saved[-1] >= 4, f"{saved}\n{child.output}"
    resumed = spawn(trainer(tmp_path), env=CLEAN)
    assert resumed.wait(120) == 0, resumed.output
    assert f"resumed {saved[-1]}" in resumed.lines, resumed.output
    final, ref = (torch.load(p, weights_only=True) for p in (tmp_path / "final.pt", reference))
    assert final.keys() == ref.keys()
    for name in ref:
        assert torch.equal(final[name], ref[name]), f"{name} differs after the resume"


def test_ec2_spot_interruption_two_minutes_scaled_to_five_seconds(
    metadata_server: MetadataServer, reference: Path, tmp_path: Path, spawn
) -> None:
    def notice() -> float:
        metadata_server.state.ec2_interrupt(in_seconds=5)  # EC2 gives whole seconds: 4-5 s from now
        return ec2_deadline(metadata_server)

    env = {"AWS_EC2_METADATA_SERVICE_ENDPOINT": metadata_server.url}
    child, deadline, gone = preempt(spawn, tmp_path, env, notice)
    assert "EC2 Spot interruption: terminate" in child.output
    assert_gone_in_time_and_exact(spawn, tmp_path, reference, child, deadline, gone)


def test_azure_preempt_event_with_a_deadline_of_five_seconds(
    metadata_server: MetadataServer, reference: Path, tmp_path: Path, spawn
) -> None:
    events: list[str] = []

    def notice() -> float:
        events.append(
            metadata_server.state.azure_event("Preempt", not_before_in=5)
        )  # whole seconds
        not_before = metadata_server.state.azure_events[-1]["NotBefore"]
        return email.utils.parsedate_to_datetime(not_before).timestamp()

    env = {"PREEMPTIBLE_AZURE_METADATA_ENDPOINT": metadata_server.url}
    child, deadline, gone = preempt(spawn, tmp_path, env, notice)
    assert metadata_server.state.azure_acks == events, "acknowledged after the final checkpoint"
    assert_gone_in_time_and_exact(spawn, tmp_path, reference, child, deadline, gone)


def test_gce_window_scaled_to_five_seconds_counts_from_the_notice_not_its_detection(
    metadata_server: MetadataServer, reference: Path, tmp_path: Path, spawn
) -> None:
    def notice() -> float:
        # GCE gives no time: its window starts when the notice is set, which the watcher
        # sees up to one poll later (detection latency)
        now = time.time()
        metadata_server.state.gce_preempted = "TRUE"
        return now + 5

    env = {"GCE_METADATA_HOST": metadata_server.host, "PREEMPTIBLE_GCE_NOTICE_SECONDS": "5"}
    child, deadline, gone = preempt(spawn, tmp_path, env, notice)
    assert "GCE preempted this Spot/preemptible VM" in child.output
    assert_gone_in_time_and_exact(spawn, tmp_path, reference, child, deadline, gone)


def test_the_measured_exit_of_an_attempt_is_budgeted_for_the_next(
    metadata_server: MetadataServer, tmp_path: Path, spawn
) -> None:
    """The job spends 2 s on its way out (train.py --linger 1: 1 s in a finally block, 1 s in
    atexit), more than the default budget (about 1.5 s). The first attempt is stopped by a
    plain SIGTERM; its exit is measured and passed on, and the second attempt, given a notice
    with a deadline 6-7 s away, saves early enough to be gone before it."""
    pid_file = tmp_path / "job.pid"
    env = {**CLEAN, "PREEMPTIBLE_POLL_INTERVAL": "0.2"}
    env["PREEMPTIBLE_AZURE_METADATA_ENDPOINT"] = metadata_server.url
    sup = supervise(
        spawn,
        tmp_path,
        "--max-preemptions",
        "1",
        "--pid-file",
        str(pid_file),
        "--",
        *trainer(tmp_path, "--step-sleep", "0.15", "--linger", "1", "--steps", "100000"),
        env=env,
    )
    sup.wait_line(lambda line: line == "step 3", timeout=60)
    first = read_pid(pid_file)
    os.kill(first, signal.SIGTERM)  # the job alone: a supervisor told to stop would not restart
    resumed = sup.wait_line(lambda line: line.startswith("resumed ") and line != "resumed 0", 60)
    # the first attempt saved after step k - 1 and never printed "step k"
    k = int(resumed.split()[1])
    sup.wait_line(lambda line: line == f"step {k + 1}", timeout=60)
    metadata_server.state.azure_event("Preempt", not_before_in=7)
    deadline = email.utils.parsedate_to_datetime(
        metadata_server.state.azure_events[-1]["NotBefore"]
    ).timestamp()
    try:
        sup.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running 30 s after the notice:\n{sup.output}") from None
    gone = time.time()
    assert sup.wait(10) == 143, sup.output
    one, two = attempts(tmp_path)
    assert one["state"] == two["state"] == "PREEMPTED", sup.output
    assert float(one["exit_s"]) >= 2.0, one  # the two lingers, at least
    assert float(two["exit_s"]) >= 2.0, two
    assert gone < deadline, f"gone {gone - deadline:.2f} s after the deadline\n{sup.output}"


EXIT_CHILD = """
import resource, sys
import torch  # its modules and objects: what every training program keeps to the end
from preemptible.stop._termination import exit_process
usage = resource.getrusage(resource.RUSAGE_SELF)
print(usage.ru_utime + usage.ru_stime, flush=True)
(exit_process if sys.argv[1] == "ours" else sys.exit)(3)
"""


def exit_cpu(how: str) -> float:
    """CPU seconds a process spends from its exit call to its end (load-independent)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", EXIT_CHILD, how], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        before = float(proc.stdout.readline())
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        if proc.returncode is None:
            proc.kill()
        proc.returncode = 0  # reaped by wait4
    assert os.waitstatus_to_exitcode(status) == 3
    return usage.ru_utime + usage.ru_stime - before


@pytest.mark.timeout(60)
def test_the_default_exit_skips_the_collections_over_the_heap_at_shutdown() -> None:
    ours, plain = exit_cpu("ours"), exit_cpu("plain")
    assert ours < plain / 2, f"exit_process {ours:.2f} s of CPU, sys.exit {plain:.2f} s"


CAUGHT_CHILD = """
import gc, json
from preemptible.stop._termination import exit_process
try:
    exit_process(5)
except SystemExit as exc:
    code = exc.code
a = []; a.append(a); del a  # a cycle: collected, the collector is untouched
print(json.dumps([code, gc.get_freeze_count(), gc.collect() >= 1]), flush=True)
"""


@pytest.mark.timeout(60)
def test_a_caught_exit_leaves_the_collector_alone() -> None:
    """A notebook catches the SystemExit: the heap is only frozen when the process ends."""
    out = subprocess.run(
        [sys.executable, "-c", CAUGHT_CHILD], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [5, 0, True]
