"""The stop of a run whose checkpoints are in a bucket: its checkpoint reaches the bucket before
the process exits, and with a deadline the process is gone in time whatever the network does.

Real processes, a real S3-protocol server (moto's, tests/support/buckets.py) stalled by SIGSTOP
for the test that needs an upload that cannot finish. The runs that resume on a new machine from
what reached the bucket are in the front ends' own test files and test_supervisor.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from preemptible import PreemptionCheckpointHandler, TerminationConfig
from preemptible.checkpoint._location import Location
from tests.conftest import PY, attempts, supervise
from tests.support.buckets import Bucket, S3Server
from tests.support.env import CLEAN
from tests.support.faults import fault_proxy

pytestmark = pytest.mark.timeout(120)

# a handler on a bucket (save_fn: no torch to import); its first checkpoint is uploaded, then
# it trains until stopped
PROGRAM = """\
import dataclasses, json, os, sys, time
import preemptible
from preemptible.notices import default_config
sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line

state = {"x": 0}
save = lambda path: path.write_text(json.dumps(state))
config = dataclasses.replace(default_config(), save_fn=save)
handler = preemptible.PreemptionCheckpointHandler(os.environ["CKPT_URL"], termination_config=config)
handler.save(0)
assert handler.store.flush(time.monotonic() + 30)
for step in handler.steps(10**6):
    state["x"] += 1
    print(f"step {step}", flush=True)
    time.sleep(0.05)
"""

WINDOW = 8.0  # PREEMPTIBLE_GRACE_PERIOD: SIGKILL then; the trainer aims to be gone 5 s before


def test_a_stop_whose_upload_cannot_finish_is_gone_before_its_deadline_and_says_so(
    own_s3_server: S3Server, tmp_path: Path, spawn
) -> None:
    """SIGTERM with a grace period while the bucket's server hangs: the stop's checkpoint is
    committed locally, its upload waits only for what the deadline leaves, one line names the
    upload that did not finish and the newest checkpoint that is in the bucket, the run record
    names that one (``remote_checkpoint``), and the process exits 143 before the deadline (no
    second wait at exit)."""
    own_s3_server.create_bucket("stall")
    attempt = tmp_path / "attempt"
    env = {
        **CLEAN,
        **own_s3_server.env(),
        "PREEMPTIBLE_STAGING_DIR": str(tmp_path / "staging"),
        "PREEMPTIBLE_GRACE_PERIOD": str(WINDOW),
        "PREEMPTIBLE_RUN_DIR": str(attempt),  # the record is written, as under a supervisor
        "CKPT_URL": "s3://stall/run",
    }
    child = spawn([PY, "-c", PROGRAM], env=env)
    child.wait_line(lambda line: line == "step 3", timeout=60)
    assert own_s3_server.directory is not None
    server = int((own_s3_server.directory / "pid").read_text())
    os.kill(server, signal.SIGSTOP)
    try:
        child.signal(signal.SIGTERM)
        sent = time.monotonic()
        rc = child.wait(60)
        gone = time.monotonic() - sent
    finally:
        os.kill(server, signal.SIGCONT)
    assert rc == 143, child.output
    # the deadline is WINDOW - 5 s after the signal; preemptible run would escalate at WINDOW - 2
    assert gone < WINDOW - 2, f"{gone:.2f} s\n{child.output}"
    said = [line for line in child.lines if "did not finish in time" in line]
    assert len(said) == 1, child.output
    assert "step-0000000000.ckpt" in said[0] and "s3://stall/run" in said[0], said
    record = json.loads((attempt / "record.json").read_text())
    assert record["state"] == "stopped", record
    assert record["remote_checkpoint"] == "s3://stall/run/step-0000000000.ckpt", record
    stopped = sorted(p.name for p in (tmp_path / "staging").glob("*/step-*.ckpt"))[-1]
    assert stopped != "step-0000000000.ckpt", "the stop's checkpoint is committed locally"

    # The same machine starts again, the server back: its writer uploads the checkpoint that
    # never went up (else a finished run would stay finished here, and a new machine would
    # resume from step 0).
    again = subprocess.run([PY, "-c", RESTART], env=env, capture_output=True, text=True, timeout=90)
    assert again.returncode == 0, again.stderr
    assert f"uploading {stopped} to s3://stall/run" in again.stderr, again.stderr
    keys = own_s3_server.objects("stall", "run/")
    assert any(k.startswith(f"manifests/{stopped}/") for k in keys), sorted(keys)


RESTART = """\
import os, time, preemptible
store = preemptible.CheckpointStore(os.environ["CKPT_URL"])
store.lock()
assert store.flush(time.monotonic() + 60)
"""


def test_the_grace_policy_counts_a_bucket_s_upload_in_a_save(
    s3_bucket: Bucket, signal_handlers: object
) -> None:
    """A stop's checkpoint must reach the bucket before the exit: the save time the grace
    policy budgets with is the save and the last measured upload together, including for a
    save made before any upload was measured (a notice's insurance checkpoint, the first of
    its run: the stop after it must budget that checkpoint's own upload)."""
    config = TerminationConfig(save_fn=lambda path: path.write_text("{}"))
    with PreemptionCheckpointHandler(s3_bucket.url, termination_config=config) as handler:
        handler.save(1)
        assert handler.store.flush(time.monotonic() + 30)
        assert handler.store.mirror is not None
        uploaded = handler.store.mirror.upload_seconds
        assert uploaded is not None and uploaded > 0
        assert len(handler.save_times) == 1 and handler.save_times.max() >= uploaded
        handler.save(2)
        assert len(handler.save_times) == 2 and handler.save_times.max() >= uploaded
        assert handler.store.flush(time.monotonic() + 30)  # nothing left for the exit


def test_a_run_that_ends_uploads_its_last_checkpoint_at_the_exit_and_leaves_keep_there(
    s3_bucket: Bucket, tmp_path: Path
) -> None:
    """A run that ends without a stop leaves its last upload to the interpreter's exit (the
    atexit flush): by then Python refuses new work to its thread pools, so the upload must need
    none. The retention after it runs in the upload's thread, and the exit waits for it too (a
    stop does not), or the bucket keeps one more than ``keep`` for good. The process saves and
    returns at once; after it, the bucket holds its last checkpoint only."""
    program = (
        "import os, time, preemptible\n"
        "store = preemptible.CheckpointStore(os.environ['CKPT_URL'], keep=1)\n"
        "for step in (1, 2):\n"
        "    store.save(step, lambda tmp: tmp.write_bytes(b'x'))\n"
        "    assert store.flush(time.monotonic() + 30)\n"
        "store.save(3, lambda tmp: tmp.write_bytes(b'last'))\n"
    )
    env = {**os.environ, **CLEAN, **s3_bucket.env, "CKPT_URL": s3_bucket.url}
    done = subprocess.run([PY, "-c", program], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "failed" not in done.stderr, done.stderr
    assert sorted(k for k in s3_bucket.objects() if k.startswith("manifests/")) == [
        "manifests/step-0000000003.ckpt/0000000001.json"
    ], done.stderr


TERM_TIMEOUT = 8.0  # preemptible run --term-timeout: the supervisor's SIGKILL of the job then


def test_a_plain_sigterm_under_run_ends_the_upload_wait_before_the_supervisor_s_kill(
    s3_bucket: Bucket, tmp_path: Path, spawn
) -> None:
    """``preemptible run --term-timeout 8`` on a bucket, a plain SIGTERM (no deadline of its
    own) while the bucket stalls: the job knows the supervisor's kill comes 8 s after the stop
    (``PREEMPTIBLE_KILL_AFTER``), so its wait for the stop's upload ends before it: one line
    names the newest checkpoint in the bucket, the job exits 143 by itself (the attempt is not
    killed), the run is PREEMPTED, and the supervisor is gone within the term timeout. It used
    to wait up to 600 s and be SIGKILLed at 8 s without a word."""
    with fault_proxy(s3_bucket.server.endpoint) as proxy:
        sup = supervise(
            spawn,
            tmp_path,
            "--term-timeout",
            f"{TERM_TIMEOUT:g}",
            "--checkpoint-dir",
            s3_bucket.url,
            "--",
            PY,
            "-c",
            PROGRAM,
            env={**CLEAN, "AWS_ENDPOINT_URL": proxy.endpoint, "CKPT_URL": s3_bucket.url},
        )
        sup.wait_line(lambda line: line == "step 3", timeout=60)  # step 0 is in the bucket
        proxy.stall.set()  # from now on every request hangs
        sent = time.monotonic()
        sup.signal(signal.SIGTERM)
        rc = sup.wait(30)
        took = time.monotonic() - sent
    assert rc == 143, sup.output
    assert took < TERM_TIMEOUT, f"{took:.2f} s\n{sup.output}"
    said = [line for line in sup.lines if "did not finish in time" in line]
    assert len(said) == 1, sup.output
    assert s3_bucket.url in said[0] and said[0].endswith("in the bucket is step-0000000000.ckpt")
    [a] = attempts(tmp_path)
    assert (a["state"], a["ending"], a.get("killed")) == ("PREEMPTED", "exit 143", None), a
    [record] = (tmp_path / ".preemptible" / "runs").glob("*/attempt-1/record.json")
    assert json.loads(record.read_text())["remote_checkpoint"] == (
        f"{s3_bucket.url}/step-0000000000.ckpt"
    )
    # the run's last line: the stop's checkpoint is kept here and resumed from by the next
    # start on this machine; another machine resumes from the bucket's (it used to name only
    # the bucket's, as if the stop's checkpoint were lost)
    stopped = json.loads(record.read_text())["checkpoint"]
    [end] = [line for line in sup.lines if "ends PREEMPTED, exit code 143" in line]
    assert f"resumes it from {Path(stopped).name}, kept in {Path(stopped).parent}" in end, end
    assert end.endswith(f"another machine resumes from {s3_bucket.url}/step-0000000000.ckpt)")


def test_a_stop_says_what_it_waits_for_and_a_second_signal_leaves_at_once(
    s3_bucket: Bucket, tmp_path: Path, spawn
) -> None:
    """A plain SIGTERM (no deadline but the 600 s cap) while the bucket stalls: after the stop's
    line the process says it waits for the stop's upload, how long at most, and which
    checkpoint the bucket holds meanwhile; a second SIGTERM then exits 143 at once. Then the
    same stop with the bucket answering: the line after the wait names what reached the
    bucket. Both waits used to be silent (a process that said "exiting" and went on for up to
    10 minutes)."""
    env = {
        **CLEAN,
        "PREEMPTIBLE_STAGING_DIR": str(tmp_path / "staging"),
        "CKPT_URL": s3_bucket.url,
    }
    with fault_proxy(s3_bucket.server.endpoint) as proxy:
        child = spawn([PY, "-c", PROGRAM], env={**env, "AWS_ENDPOINT_URL": proxy.endpoint})
        child.wait_line(lambda line: line == "step 3", timeout=60)  # step 0 is in the bucket
        proxy.stall.set()
        child.signal(signal.SIGTERM)
        waiting = child.wait_line(lambda line: "for the upload of" in line, timeout=30)
        child.signal(signal.SIGTERM)
        sent = time.monotonic()
        rc = child.wait(30)
        took = time.monotonic() - sent
    assert rc == 143, child.output
    assert took < 5, f"{took:.2f} s\n{child.output}"
    assert "waiting up to 6" in waiting and f"to {s3_bucket.url} before exiting" in waiting
    assert waiting.endswith("the newest checkpoint in the bucket is step-0000000000.ckpt)")
    assert not any(line.startswith("preemptible: uploaded") for line in child.lines)
    # the second signal's line says where the stop's checkpoint is, and that it is not lost
    abandoned = waiting.split("for the upload of ")[1].split()[0]
    [second] = [line for line in child.lines if "after the checkpoint was committed" in line]
    staging = tmp_path / "staging" / Location.parse(s3_bucket.url).slug()
    assert second.endswith(
        f"exiting now with 143; {abandoned} is not in {s3_bucket.url} (the newest there is "
        f"step-0000000000.ckpt): it stays in {staging}, and the next start on this machine "
        "uploads it"
    ), child.output

    child = spawn([PY, "-c", PROGRAM], env=env)  # resumes from staging, the bucket answering
    child.wait_line(lambda line: line.startswith("step ") and int(line[5:]) > 3, timeout=60)
    assert any(
        line.startswith(f"preemptible: uploading {abandoned} to {s3_bucket.url}: an earlier run")
        for line in child.lines
    ), child.output
    child.signal(signal.SIGTERM)
    assert child.wait(60) == 143, child.output
    [stopped] = [line for line in child.lines if line.startswith("preemptible: stopped at step")]
    name = stopped.split("/")[-1].split(";")[0]
    assert f"preemptible: uploaded {name} to {s3_bucket.url}" in child.lines, child.output
    assert any(k.startswith(f"manifests/{name}/") for k in s3_bucket.objects()), child.output


UNCLOSED = """\
import dataclasses, json, os, sys, time
import preemptible
from preemptible.notices import default_config

config = dataclasses.replace(default_config(), save_fn=lambda path: path.write_text("{}"))
handler = preemptible.PreemptionCheckpointHandler(os.environ["CKPT_URL"], termination_config=config)
handler.step = 1
assert not handler.should_stop  # a boundary: its signal handlers are in place, never closed
print("ready", flush=True)
sys.stdin.readline()
handler.save(2)
"""


def test_a_signal_during_the_upload_at_exit_ends_the_process(
    s3_bucket: Bucket, tmp_path: Path, spawn
) -> None:
    """A program that leaves its handler open ends while the bucket stalls: the exit waits for
    its last upload and says a signal ends the wait; SIGTERM then ends the process at once, as
    without preemptible. The handler's latch used to take the SIGTERM for a stop no loop would
    act on: the process went on waiting (up to 600 s) and then exited 0."""
    env = {**CLEAN, "PREEMPTIBLE_STAGING_DIR": str(tmp_path / "staging"), "CKPT_URL": s3_bucket.url}
    with fault_proxy(s3_bucket.server.endpoint) as proxy:
        child = spawn(
            [PY, "-c", UNCLOSED],
            env={**env, "AWS_ENDPOINT_URL": proxy.endpoint},
            stdin=subprocess.PIPE,
        )
        child.wait_line(lambda line: line == "ready", timeout=60)
        proxy.stall.set()
        assert child.proc.stdin is not None
        child.proc.stdin.write("go\n")
        child.proc.stdin.flush()
        waiting = child.wait_line(lambda line: "for the upload of" in line, timeout=30)
        child.signal(signal.SIGTERM)
        rc = child.wait(10)
    assert "step-0000000002.ckpt" in waiting and "a signal now exits at once" in waiting
    assert rc == -signal.SIGTERM, child.output


FINISHES = PROGRAM.replace("handler.steps(10**6)", "handler.steps(40)")


def test_a_run_that_trains_to_its_end_after_a_stop_leaves_before_the_supervisor_s_kill(
    s3_bucket: Bucket, tmp_path: Path, spawn
) -> None:
    """SIGTERM with a grace period long enough to train to the end (an insurance checkpoint,
    then the last steps), under a supervisor that kills 4 s after the signal, while the bucket
    stalls: the upload of the last checkpoint at the interpreter's exit is waited for only
    until just before that kill, and one line names the newest checkpoint in the bucket. The
    exit's wait used to be 600 s whatever the stop said: killed with no word."""
    env = {
        **CLEAN,
        "PREEMPTIBLE_STAGING_DIR": str(tmp_path / "staging"),
        "PREEMPTIBLE_GRACE_PERIOD": "30",
        "PREEMPTIBLE_KILL_AFTER": "4",  # as preemptible run tells its attempts
        "CKPT_URL": s3_bucket.url,
    }
    with fault_proxy(s3_bucket.server.endpoint) as proxy:
        child = spawn([PY, "-c", FINISHES], env={**env, "AWS_ENDPOINT_URL": proxy.endpoint})
        child.wait_line(lambda line: line == "step 5", timeout=60)  # step 0 is in the bucket
        proxy.stall.set()
        child.signal(signal.SIGTERM)
        sent = time.monotonic()
        rc = child.wait(30)
        took = time.monotonic() - sent
    assert rc == 0 and "step 39" in child.lines, child.output  # it trained to its end
    # the wait ends 1 s before the kill (EXIT_MARGIN); the exit after it is quick, but this
    # machine may be loaded: the bound the process chose is read from its line
    [waiting] = [line for line in child.lines if "for the upload of step-0000000040" in line]
    bound = re.search(r"waiting up to (\d+) s", waiting)
    assert bound and int(bound.group(1)) <= 3, waiting
    assert took < 4 + 1.5, f"{took:.2f} s\n{child.output}"
    said = [line for line in child.lines if "did not finish in time" in line]
    assert len(said) == 1 and said[0].endswith("in the bucket is step-0000000000.ckpt"), said


AGENT_SHUTDOWN = 6  # torchrun's SIGKILL of its workers, in seconds after it passes a stop on


def test_a_torchrun_worker_s_upload_wait_ends_before_the_agent_s_kill(
    s3_bucket: Bucket, tmp_path: Path, spawn
) -> None:
    """torchrun passes a SIGTERM on to its workers and SIGKILLs them its shutdown timeout
    later (30 s unless told; here ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``), while the bucket
    stalls: the worker's wait for the stop's upload ends before that kill, one line names the
    newest checkpoint in the bucket, and the worker exits 143 by itself. It used to wait up to
    600 s (or the supervisor's term timeout, 60 s by default) and be killed by the agent
    without a word."""
    torchrun = str(Path(PY).with_name("torchrun"))
    env = {
        **CLEAN,
        "PREEMPTIBLE_STAGING_DIR": str(tmp_path / "staging"),
        "CKPT_URL": s3_bucket.url,
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(AGENT_SHUTDOWN),
        "OMP_NUM_THREADS": "1",
    }
    with fault_proxy(s3_bucket.server.endpoint) as proxy:
        program = tmp_path / "train.py"
        program.write_text(PROGRAM)
        child = spawn(
            [torchrun, "--standalone", "--nproc-per-node", "1", str(program)],
            env={**env, "AWS_ENDPOINT_URL": proxy.endpoint},
        )
        child.wait_line(lambda line: line == "step 3", timeout=90)  # step 0 is in the bucket
        proxy.stall.set()
        child.signal(signal.SIGTERM)
        sent = time.monotonic()
        child.wait(60)
        took = time.monotonic() - sent
    [waiting] = [line for line in child.lines if "for the upload of" in line]
    bound = re.search(r"waiting up to (\d+) s", waiting)
    assert bound and int(bound.group(1)) < AGENT_SHUTDOWN, waiting
    said = [line for line in child.lines if "did not finish in time" in line]
    assert len(said) == 1, child.output
    assert said[0].endswith("in the bucket is step-0000000000.ckpt"), said
    assert not any("forcefully exiting via 9" in line for line in child.lines), child.output
    assert "exiting with 143" in child.output, child.output
    assert took < AGENT_SHUTDOWN + 5, f"{took:.2f} s\n{child.output}"
