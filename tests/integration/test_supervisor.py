"""``preemptible run`` with real processes: forwarding, the state table, restarts, escalation."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from preemptible.stop._signals import DUPLICATE_WINDOW
from tests.conftest import (
    PY,
    SCRIPTS,
    attempts,
    group_members,
    process_state,
    python_args,
    read_pid,
    supervise,
    wait_for,
)
from tests.scripts.lease_train import expected
from tests.support.buckets import Bucket
from tests.support.machines import Machine

pytestmark = pytest.mark.timeout(180)


def test_signal_reaches_the_grandchild_under_bash(tmp_path: Path, spawn) -> None:
    train = " ".join(
        python_args(
            "train.py", "--ckpt", "ck", "--out", "o.pt", "--steps", "1000", "--step-sleep", "0.02"
        )
    )
    sup = supervise(spawn, tmp_path, "--", "bash", "-c", f"{train}; echo done")
    sup.wait_line(lambda line: line == "step 3", timeout=60)
    sup.signal(signal.SIGTERM)
    assert sup.wait(60) == 143, sup.output
    assert "received SIGTERM" in sup.output  # the trainer's own latch ran
    assert "done" not in sup.lines  # bash itself died from the forwarded signal
    [a] = attempts(tmp_path)
    assert a["state"] == "PREEMPTED" and a["ending"] == "killed by SIGTERM"
    assert len(list((tmp_path / "ck").glob("step-*.ckpt"))) == 1


def test_sigkill_of_the_supervisor_leaves_no_process_behind(tmp_path: Path, spawn) -> None:
    pid_file = tmp_path / "job.pid"
    sup = supervise(
        spawn,
        tmp_path,
        "--pid-file",
        str(pid_file),
        "--",
        "bash",
        "-c",
        "sleep 1000 & sleep 1000 & wait",
    )
    pgid = read_pid(pid_file)
    wait_for(lambda: len(group_members(pgid)) >= 3, 30, "bash and two sleeps")
    sup.proc.kill()  # SIGKILL: no handler of the supervisor runs
    wait_for(lambda: not group_members(pgid), 10, "the job's process group to be gone")


@pytest.mark.parametrize(
    ("mark", "end", "state", "code"),
    [
        ("none", "exit0", "FINISHED", 0),
        ("none", "exit3", "FAILED", 3),
        ("none", "sigkill", "CRASHED", 137),
        ("none", "sigint", "KILLED", 130),
        ("none", "sigterm", "CRASHED", 143),
        ("stopping", "exit0", "PREEMPTED", 143),
        ("stopping", "exit3", "PREEMPTED", 143),
        ("stopping", "sigkill", "CRASHED", 137),
        ("stopping", "sigint", "PREEMPTED", 130),
        ("stopping", "sigusr1", "PREEMPTED", 138),
        ("start", "exit0", "FINISHED", 0),
        ("start", "exit3", "PREEMPTED", 143),
        ("start", "sigkill", "PREEMPTED", 137),
        ("start", "sigint", "PREEMPTED", 130),
        ("start", "sigterm", "PREEMPTED", 143),
    ],
)
def test_state_table_with_real_endings(
    mark: str, end: str, state: str, code: int, tmp_path: Path, spawn
) -> None:
    sup = supervise(
        spawn, tmp_path, "--max-preemptions", "0", "--", *python_args("ending.py", mark, end)
    )
    assert sup.wait(60) == code, sup.output
    [a] = attempts(tmp_path)
    assert a["state"] == state, sup.output


def test_a_wrapper_that_exits_0_after_a_preempted_child(tmp_path: Path, spawn) -> None:
    train = " ".join(
        python_args(
            "train.py", "--ckpt", "ck", "--out", "o.pt", "--steps", "1000", "--step-sleep", "0.02"
        )
    )
    pid_file = tmp_path / "trainer.pid"
    # the trainer is preempted by a signal the supervisor never saw; the shell then exits 0
    sup = supervise(
        spawn,
        tmp_path,
        "--max-preemptions",
        "0",
        "--",
        "bash",
        "-c",
        f"{train} & echo $! > {pid_file}; wait; exit 0",
    )
    sup.wait_line(lambda line: line == "step 3", timeout=60)
    os.kill(read_pid(pid_file), signal.SIGUSR2)
    assert sup.wait(60) == 140, sup.output
    [a] = attempts(tmp_path)
    assert a["state"] == "PREEMPTED" and a["ending"] == "exit 0"


def test_restart_resumes_and_ends_bit_exact(tmp_path: Path, spawn) -> None:
    ref = spawn(
        python_args(
            "train.py",
            "--ckpt",
            str(tmp_path / "ref"),
            "--out",
            str(tmp_path / "ref.pt"),
            "--steps",
            "30",
        )
    )
    assert ref.wait(120) == 0
    pid_file = tmp_path / "job.pid"
    sup = supervise(
        spawn,
        tmp_path,
        "--checkpoint-dir",
        "ck",
        "--pid-file",
        str(pid_file),
        "--",
        *python_args(
            "train.py", "--ckpt", "ck", "--out", "o.pt", "--steps", "30", "--step-sleep", "0.05"
        ),
    )
    sup.wait_line(lambda line: line == "step 9", timeout=60)
    os.kill(read_pid(pid_file), signal.SIGTERM)  # a preemption the supervisor did not see
    assert sup.wait(180) == 0, sup.output
    first, second = attempts(tmp_path)
    assert (first["state"], second["state"]) == ("PREEMPTED", "FINISHED")
    assert "resuming from" in sup.output
    # the second attempt starts after the last step the first one ran
    restart = next(i for i, line in enumerate(sup.lines) if "resuming from" in line)
    last = max(int(line[5:]) for line in sup.lines[:restart] if re.fullmatch(r"step \d+", line))
    assert last >= 9 and f"resumed {last + 1}" in sup.lines[restart:], sup.output
    assert_same_weights(tmp_path / "ref.pt", tmp_path / "o.pt")


def assert_same_weights(ref: Path, out: Path) -> None:
    a = torch.load(ref, weights_only=True)
    b = torch.load(out, weights_only=True)
    assert a and a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_term_timeout_escalates_to_sigkill(tmp_path: Path, spawn) -> None:
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(1000)"
    )
    sup = supervise(spawn, tmp_path, "--term-timeout", "1", "--", PY, "-c", stubborn)
    sup.wait_line(
        lambda line: line.startswith("up"), timeout=30
    )  # a log line may land before its "\n"
    sent = time.monotonic()
    sup.signal(signal.SIGTERM)
    assert sup.wait(30) == 143, sup.output  # stopped by the SIGTERM, for all that it ignored it
    assert 0.9 < time.monotonic() - sent < 5
    assert "SIGKILL in 1 s" in sup.output and "sending SIGKILL" in sup.output
    [a] = attempts(tmp_path)  # the supervisor's own SIGKILL, after its stop: PREEMPTED
    assert (a["state"], a["ending"], a["killed"]) == ("PREEMPTED", "killed by SIGKILL", True)


def test_second_signal_is_forwarded_and_hard_exits_the_trainer(tmp_path: Path, spawn) -> None:
    sup = supervise(
        spawn,
        tmp_path,
        "--",
        *python_args(
            "train.py",
            "--ckpt",
            "ck",
            "--out",
            "o.pt",
            "--steps",
            "1000",
            "--slow-save",
            "30",
            "--step-sleep",
            "0.02",
        ),
    )
    sup.wait_line(lambda line: line == "step 3", timeout=60)
    sup.signal(signal.SIGINT)
    sup.wait_line(lambda line: line == "saving", timeout=30)
    # a person's second Ctrl+C comes later than a duplicate delivery of the first could:
    # "saving" shows the supervisor passed the first one on
    took = time.monotonic()
    wait_for(lambda: time.monotonic() - took > DUPLICATE_WINDOW + 0.2, 5, "the duplicate window")
    sup.signal(signal.SIGINT)
    assert sup.wait(30) == 130, sup.output
    [a] = attempts(tmp_path)
    assert a["state"] == "PREEMPTED" and a["ending"] == "exit 1"


def test_no_forward_signals(tmp_path: Path, spawn) -> None:
    sup = supervise(
        spawn,
        tmp_path,
        "--no-forward-signals",
        "--term-timeout",
        "1",
        "--",
        *python_args(
            "train.py", "--ckpt", "ck", "--out", "o.pt", "--steps", "100000", "--step-sleep", "0.02"
        ),
    )
    sup.wait_line(lambda line: line == "step 3", timeout=60)
    sup.signal(signal.SIGTERM)
    assert sup.wait(30) == 143, sup.output  # the stop it received, left to the platform
    assert "received SIGTERM" not in sup.output
    assert "received; not passed to" in sup.output
    [a] = attempts(tmp_path)
    assert (a["state"], a["forwarded"], a["killed"]) == ("PREEMPTED", [False], True)


def test_failure_budget_and_environment(tmp_path: Path, spawn) -> None:
    code = (
        "import preemptible, sys; r = preemptible.current_run(); "
        "print('ENV', r.run_id, r.attempt, r.run_dir.name, r.checkpoint_dir.name, flush=True); "
        "sys.exit(3)"
    )
    sup = supervise(
        spawn, tmp_path, "--max-failures", "2", "--run-id", "exp-1", "--", PY, "-c", code
    )
    assert sup.wait(60) == 3, sup.output
    assert [line for line in sup.lines if line.startswith("ENV")] == [
        f"ENV exp-1 {n} attempt-{n} checkpoints" for n in (1, 2, 3)
    ]
    assert [a["state"] for a in attempts(tmp_path)] == ["FAILED"] * 3
    assert "3 attempts failed or crashed; --max-failures is 2; giving up" in sup.output


def test_flapping_guard(tmp_path: Path, spawn) -> None:
    sup = supervise(spawn, tmp_path, "--", *python_args("ending.py", "start", "exit3"))
    assert sup.wait(60) == 143, sup.output
    assert len(attempts(tmp_path)) == 5
    assert "the last 5 attempts each ended within 10 s" in sup.output


def test_told_to_stop_means_no_restart(tmp_path: Path, spawn) -> None:
    sup = supervise(
        spawn,
        tmp_path,
        "--",
        *python_args(
            "train.py", "--ckpt", "ck", "--out", "o.pt", "--steps", "100000", "--step-sleep", "0.02"
        ),
    )
    sup.wait_line(lambda line: line == "step 2", timeout=60)
    sup.signal(signal.SIGUSR1)
    assert sup.wait(60) == 138, sup.output
    assert [a["state"] for a in attempts(tmp_path)] == ["PREEMPTED"]


def test_slurm_without_scontrol_is_a_clear_error(tmp_path: Path, spawn) -> None:
    env = {"SLURM_JOB_ID": "4242", "PATH": str(Path(PY).parent)}
    sup = supervise(spawn, tmp_path, "--", *python_args("ending.py", "stopping", "exit1"), env=env)
    assert sup.wait(60) == 143, sup.output
    assert "cannot requeue SLURM job 4242: scontrol is not on PATH" in sup.output
    assert (tmp_path / ".preemptible" / "runs" / "slurm-4242").is_dir()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "Missing argument 'COMMAND"),
        (["--", "/nonexistent/prog"], "cannot start '/nonexistent/prog'"),
        (["--run-id", "../escape", "--", "true"], "run id '../escape' (from --run-id) is not"),
        (["--run-id", "exp\n", "--", "true"], "run id 'exp\\n' (from --run-id) is not valid"),
        (["--home", "/etc/passwd/x", "--", "true"], "cannot create the run directory"),
        (["--restart-delay", "1e300", "--", "true"], "Invalid value for '--restart-delay'"),
        (["--max-failures", "-1", "--", "true"], "Invalid value for '--max-failures'"),
        (["--checkpoint-dir", "s3://ckpt/a/../b", "--", "true"], "'..' are not valid in the"),
        (["--checkpoint-dir", "ftp://ckpt/a", "--", "true"], "unknown scheme 'ftp'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], message: str, tmp_path: Path, spawn
) -> None:
    sup = supervise(spawn, tmp_path, *args)
    assert sup.wait(30) == 2, sup.output
    assert message in sup.output
    assert "Traceback" not in sup.output


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("sig", "state", "code"),
    [(signal.SIGTERM, "PREEMPTED", 143), (signal.SIGINT, "PREEMPTED", 130)],
)
def test_an_exit_after_a_forwarded_stop_is_preempted_not_failed(
    sig: int, state: str, code: int, tmp_path: Path, spawn
) -> None:
    exits_1 = (
        "import signal, sys\n"
        f"signal.signal({int(sig)}, lambda *a: sys.exit(1))\n"
        "print('up', flush=True)\n"
        "signal.pause()\n"
    )
    sup = supervise(spawn, tmp_path, "--max-failures", "3", "--", PY, "-c", exits_1)
    sup.wait_line(
        lambda line: line.startswith("up"), timeout=30
    )  # a log line may land before its "\n"
    sup.signal(sig)
    assert sup.wait(30) == code, sup.output
    [a] = attempts(tmp_path)  # stopped, not failed: no restart and no failure spent
    assert (a["state"], a["ending"]) == (state, "exit 1"), sup.output
    assert a["forwarded"] == [True]


@pytest.mark.timeout(60)
def test_two_sigterms_50_ms_apart_are_one_stop(tmp_path: Path, spawn) -> None:
    counts_terms = (
        "import signal, sys, time\n"
        "got = []\n"
        "signal.signal(signal.SIGTERM, lambda *a: got.append(time.monotonic()))\n"
        "print('up', flush=True)\n"
        # polled, not signal.pause(): a SIGTERM handled between the test and the pause
        # would leave it waiting for a signal that has already come
        "while not got:\n"
        "    time.sleep(0.01)\n"
        # long enough for a second forwarded SIGTERM to arrive, if there is one
        f"while time.monotonic() < got[0] + {DUPLICATE_WINDOW} + 1.0:\n"
        "    time.sleep(0.05)\n"
        "print(f'terms {len(got)}', flush=True)\n"
        "sys.exit(143)\n"
    )
    sup = supervise(spawn, tmp_path, "--", PY, "-c", counts_terms)
    sup.wait_line(
        lambda line: line.startswith("up"), timeout=30
    )  # a log line may land before its "\n"
    sup.signal(signal.SIGTERM)
    time.sleep(0.05)  # the stimulus: two deliveries of one stop, 50 ms apart
    sup.signal(signal.SIGTERM)
    assert sup.wait(30) == 143, sup.output
    assert "terms 1" in sup.lines, sup.output
    [a] = attempts(tmp_path)
    assert a["signals"] == ["SIGTERM", "SIGTERM"] and a["forwarded"] == [True, False]
    assert "the same stop delivered twice" in sup.output


FORGES = """
import os, sys
path = os.path.join(os.environ["PREEMPTIBLE_RUN_DIR"], "record.json")
if sys.argv[1] == "fifo":
    os.mkfifo(path)
else:
    open(path, "w").write(sys.argv[1])
sys.exit(3)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("record", "state", "code"),
    [
        ('{"state": "stopped", "step": 1, "signum": 128}', "PREEMPTED", 143),  # 128 + 128: exit 0
        ('{"state": "stopped", "step": 1, "signum": -128}', "PREEMPTED", 143),  # 128 - 128: exit 0
        ('{"state": "stopped", "step": 1, "signum": 1e9}', "PREEMPTED", 143),
        ('{"preempting_at": "yesterday", "stopped_at": []}', "FAILED", 3),
        ('{"state": "stopping"}', "PREEMPTED", 143),  # no step, no checkpoint
        ('[{"state": "stopped"}]', "FAILED", 3),
        ("fifo", "FAILED", 3),  # reading it would block the supervisor
    ],
)
def test_a_forged_record_cannot_crash_the_supervisor_or_make_it_exit_0(
    record: str, state: str, code: int, tmp_path: Path, spawn
) -> None:
    sup = supervise(spawn, tmp_path, "--max-preemptions", "0", "--", PY, "-c", FORGES, record)
    assert sup.wait(30) == code, sup.output
    assert "Traceback" not in sup.output
    [a] = attempts(tmp_path)
    assert (a["state"], a["exit_code"]) == (state, code)


SAVE_RAISES = """
import sys, time
import numpy as np
import torch
import preemptible
sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line

state = {"model": torch.nn.Linear(2, 2), "best": 0.0}
handler = preemptible.PreemptionCheckpointHandler("ck", state, save_every_steps=5)
for step in handler.steps(100000):
    if step == 7:
        state["best"] = np.float64(1.5)  # not a plain value: the next save raises
    print(f"step {step}", flush=True)
    time.sleep(0.05)
"""


@pytest.mark.timeout(120)
def test_a_stop_whose_save_raises_is_failed_not_preempted(tmp_path: Path, spawn) -> None:
    sup = supervise(spawn, tmp_path, "--checkpoint-dir", "ck", "--", PY, "-c", SAVE_RAISES)
    sup.wait_line(lambda line: line == "step 8", timeout=60)
    sup.signal(signal.SIGTERM)
    assert sup.wait(60) == 1, sup.output  # the job's own code, not 143 ("checkpoint saved")
    [a] = attempts(tmp_path)
    assert (a["state"], a["ending"]) == ("FAILED", "exit 1"), sup.output
    assert "checkpoint none (the newest is step-0000000005.ckpt)" in sup.output
    assert "state['best']" in sup.output  # the job's own error says what was wrong
    [record] = (tmp_path / ".preemptible" / "runs").glob("*/attempt-1/record.json")
    data = json.loads(record.read_text())
    assert data["state"] == "save_failed" and "ConfigError" in data["error"], data


def runs_json(tmp_path: Path) -> dict[str, dict[str, object]]:
    out = subprocess.run(
        [PY, "-m", "preemptible", "runs", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return {r["run_id"]: r for r in json.loads(out.stdout)}


@pytest.mark.timeout(180)
def test_runs_lists_each_runs_truth_running_preempted_lost(tmp_path: Path, spawn) -> None:
    train = python_args("train.py", "--ckpt", "ck", "--out", "o.pt", "--steps", "100000")
    args = [*train, "--step-sleep", "0.05", "--save-every", "5"]
    sup = supervise(spawn, tmp_path, "--run-id", "a", "--checkpoint-dir", "ck", "--", *args)
    sup.wait_line(lambda line: line == "step 12", timeout=60)
    assert runs_json(tmp_path)["a"]["state"] == "RUNNING"
    sup.signal(signal.SIGTERM)
    assert sup.wait(60) == 143, sup.output
    [a] = [runs_json(tmp_path)["a"]]
    assert (a["state"], a["attempts"], a["exit_code"]) == ("PREEMPTED", 1, 143)
    newest = max((tmp_path / "ck").glob("step-*.ckpt"))
    assert a["checkpoint"] == str((tmp_path / "ck" / newest.name).resolve())

    # a supervisor killed without a word: its heartbeat says running, its lock is gone
    lost = supervise(
        spawn, tmp_path, "--run-id", "b", "--", PY, "-c", "import time; time.sleep(60)"
    )
    wait_for(
        lambda: (
            (tmp_path / ".preemptible/runs/b/heartbeat.json").exists()
            and runs_json(tmp_path)["b"]["state"] == "RUNNING"
        ),
        60,
        "run b to be running",
    )
    lost.proc.kill()
    lost.proc.wait(30)
    assert runs_json(tmp_path)["b"]["state"] == "LOST"
    plain = subprocess.run(
        [PY, "-m", "preemptible", "runs"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert plain.returncode == 0 and "PREEMPTED" in plain.stdout and "LOST" in plain.stdout


@pytest.mark.timeout(90)
def test_ctrl_z_stops_the_job_with_the_supervisor_and_fg_continues_both(
    tmp_path: Path, spawn
) -> None:
    """The job runs in a session of its own, out of the terminal's reach: a SIGTSTP to the
    supervisor (what Ctrl+Z sends it) stops the job too, a worker that left for a session of
    its own (as torchrun's do) included; SIGCONT (``fg``) continues them all; the run then
    ends as it would have."""
    job = (
        "import os, subprocess, sys, time\n"
        "worker = subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: "
        "time.sleep(0.05)'], start_new_session=True)\n"
        "print('pids', os.getpid(), worker.pid, flush=True)\n"
        "try:\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "finally:\n"
        "    worker.kill()\n"
    )
    sup = supervise(spawn, tmp_path, "--", PY, "-c", job)
    line = sup.wait_line(lambda line: line.startswith("pids"), timeout=30)
    pids = [sup.pid, *(int(p) for p in line.split()[1:])]
    for _ in range(3):
        sup.signal(signal.SIGTSTP)
        wait_for(lambda: all(process_state(p) == "T" for p in pids), 30, "all of them stopped")
        sup.signal(signal.SIGCONT)
        wait_for(
            lambda: all(process_state(p) in ("R", "S") for p in pids), 30, "all of them running"
        )
    assert "`fg` or `kill -CONT" in sup.output and "continued; so is the job" in sup.output
    sup.signal(signal.SIGTERM)
    assert sup.wait(30) == 143, sup.output
    [a] = attempts(tmp_path)
    assert a["state"] == "PREEMPTED" and a["forwarded"] == [True], a  # the SIGTERM, once
    assert process_state(pids[2]) in (None, "Z")


def test_a_run_in_a_bucket_stopped_on_one_machine_resumes_on_a_new_one(
    s3_bucket: Bucket, tmp_path: Path, spawn
) -> None:
    """``preemptible run --checkpoint-dir s3://...``: SIGTERM to the supervisor, the attempt
    saves, uploads and exits, the run is PREEMPTED (143). The machine is gone with its disks
    (working directory and --home, HOME and its staging directory, TMPDIR); the same command
    on a new one continues the same run (its id comes from the URL) from the bucket, and ends
    with the value of a run never stopped."""
    url = f"{s3_bucket.url}/runs/exp"
    command = [
        *("-m", "preemptible", "run", "--restart-delay", "0.05", "--checkpoint-dir", url, "--"),
        *(PY, str(SCRIPTS / "lease_train.py"), "--steps", "40", "--step-sleep", "0.05"),
    ]
    one, two = Machine(tmp_path / "one"), Machine(tmp_path / "two")
    first = spawn([PY, *command], cwd=one.cwd, env=one.env)
    first.wait_line(lambda line: line == "step 10", timeout=60)
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 143, first.output
    [a] = attempts(one.cwd)
    assert a["state"] == "PREEMPTED", a
    one.gone()
    second = spawn([PY, *command], cwd=two.cwd, env=two.env)
    assert second.wait(60) == 0, second.output
    steps = [int(line.split()[1]) for line in second.lines if line.startswith("step ")]
    assert steps[0] > 10 and steps[-1] == 39, second.output
    [final] = (two.cwd / ".preemptible" / "runs").glob("*/final.json")
    assert json.loads(final.read_text())["x"] == expected(40)
    listed = spawn([PY, "-m", "preemptible", "runs", "--json"], cwd=two.cwd, env=two.env)
    assert listed.wait(30) == 0, listed.output
    [row] = json.loads(listed.output)
    assert row["state"] == "FINISHED" and row["checkpoint"].startswith(f"{url}/step-"), row


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("own", "seen"),
    [
        ({}, ["SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"]),
        ({"PET_SIGNALS_TO_HANDLE": "SIGTERM"}, ["SIGTERM"]),  # the job's own is kept
    ],
    ids=["told", "own"],
)
def test_torchs_elastic_agent_is_told_to_pass_every_stop_signal_on(
    own: dict[str, str], seen: list[str], tmp_path: Path, spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's workers run in sessions of their own, out of reach of the signal the
    supervisor sends the job's group: the agent passes on what it is told (USR1 too)."""
    # one write: print() writes the text and the newline apart (PYTHONUNBUFFERED), and the
    # supervisor's log line, on the same pipe, could land between them
    prints = (
        "import os; os.write(1, (os.environ.get('PET_SIGNALS_TO_HANDLE', '-') + '\\n').encode())"
    )
    monkeypatch.delenv("PET_SIGNALS_TO_HANDLE", raising=False)
    sup = supervise(spawn, tmp_path, "--", PY, "-c", prints, env=own)
    assert sup.wait(30) == 0, sup.output
    assert [line for line in sup.lines if line.startswith(("SIG", "-"))] == seen, sup.output


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("own", "seen"),
    [({}, "45"), ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}, "7")],
    ids=["told", "own"],
)
def test_torchs_elastic_agent_kills_its_workers_no_earlier_than_the_supervisor(
    own: dict[str, str], seen: str, tmp_path: Path, spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun SIGKILLs its workers 30 s after it passes a stop on unless told otherwise, so
    a worker had 30 s of a 45 s term timeout (its upload's wait cut short, killed without a
    word): the agent is told the term timeout (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``); the job's
    own is kept."""
    prints = (
        "import os; os.write(1, ('timeout ' + os.environ.get('TORCH_ELASTIC_SHUTDOWN_TIMEOUT', "
        "'-') + '\\n').encode())"
    )
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    sup = supervise(spawn, tmp_path, "--term-timeout", "44.5", "--", PY, "-c", prints, env=own)
    assert sup.wait(30) == 0, sup.output
    assert [line for line in sup.lines if line.startswith("timeout ")] == [f"timeout {seen}"]
