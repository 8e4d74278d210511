"""Stops that must not be lost or misreported: duplicate deliveries, SIGHUP and nohup, a signal
after the checkpoint was committed, a run record that cannot be written. Real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import PY, attempts, python_args, supervise, wait_for
from tests.support.checkpoints import committed

pytestmark = pytest.mark.timeout(120)


def train_args(tmp_path: Path, *extra: str) -> list[str]:
    return python_args(
        "train.py",
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--out",
        str(tmp_path / "out.pt"),
        "--steps",
        "100000",
        "--step-sleep",
        "0.01",
        *extra,
    )


def signal_state(pid: int) -> str:
    """The signal lines of /proc/PID/status for the process and each of its threads."""
    keys = ("Name", "State", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    lines = []
    for status in [
        Path(f"/proc/{pid}/status"),
        *sorted(Path(f"/proc/{pid}/task").glob("*/status")),
    ]:
        try:
            text = status.read_text()
        except OSError as exc:
            lines.append(f"{status}: {exc}")
            continue
        kept = [line for line in text.splitlines() if line.split(":")[0] in keys]
        lines.append(f"{status}: " + "; ".join(kept))
    return "\n".join(lines)


def test_two_sigterms_50_ms_apart_are_one_stop(tmp_path: Path, spawn) -> None:
    child = spawn(train_args(tmp_path, "--slow-save", "0.5"))
    child.wait_line(lambda line: line == "step 5", timeout=60)
    child.signal(signal.SIGTERM)
    time.sleep(0.05)  # the gap under test, not a synchronisation
    child.signal(signal.SIGTERM)
    assert child.wait(30) == 143, child.output
    assert committed(tmp_path / "ckpt"), child.output
    assert "the same stop delivered twice" in child.output


def test_sigterm_to_supervisor_and_trainer_at_once_is_preempted(tmp_path: Path, spawn) -> None:
    pid_file = tmp_path / "job.pid"
    sup = supervise(
        spawn,
        tmp_path,
        "--pid-file",
        str(pid_file),
        "--",
        *train_args(tmp_path, "--slow-save", "0.5"),
    )
    sup.wait_line(lambda line: line == "step 5", timeout=60)
    trainer = int(pid_file.read_text())
    # what systemd's KillMode=control-group or a VM shutdown does: every process at once
    os.kill(sup.pid, signal.SIGTERM)
    os.kill(trainer, signal.SIGTERM)
    try:
        code = sup.wait(60)
    except AssertionError as exc:
        # before the fixture's cleanup kills it: what the trainer did with the two SIGTERMs
        raise AssertionError(f"{exc}\ntrainer {trainer}:\n{signal_state(trainer)}") from None
    assert code == 143, sup.output
    assert committed(tmp_path / "ckpt"), sup.output
    [attempt] = attempts(tmp_path)
    assert attempt["state"] == "PREEMPTED", attempt


# A training loop whose latch gets a second SIGTERM from inside the handler of the first, right
# after the first was recorded: where a second SIGTERM sent at the same moment (the supervisor's
# forwarded copy) can land. Python runs the second handler inside the first, at its next call.
SECOND_INSIDE_FIRST = """
import os, signal, sys
import preemptible

class SecondSigtermDuringAppend(list):
    armed = True
    def append(self, item):
        super().append(item)
        if self.armed:
            self.armed = False
            os.kill(os.getpid(), signal.SIGTERM)

h = preemptible.PreemptionCheckpointHandler(
    sys.argv[1],
    termination_config=preemptible.TerminationConfig(
        save_fn=lambda p: open(p, "w").write("x")
    ),
)
h._session.latch._received = SecondSigtermDuringAppend()  # the latch's record of signals
for step in h.steps(10**9):
    if step == 3:
        print("step 3", flush=True)
"""


def test_sigterm_landing_inside_the_first_sigterms_handler_is_one_stop(
    tmp_path: Path, spawn
) -> None:
    child = spawn([PY, "-c", SECOND_INSIDE_FIRST, str(tmp_path / "ckpt")])
    child.wait_line(lambda line: line == "step 3", timeout=60)
    child.signal(signal.SIGTERM)
    assert child.wait(30) == 143, child.output
    assert committed(tmp_path / "ckpt"), child.output
    assert "the same stop delivered twice" in child.output


def test_deliberate_second_ctrl_c_a_second_later_exits_at_once(tmp_path: Path, spawn) -> None:
    child = spawn(train_args(tmp_path, "--slow-save", "30"))
    child.wait_line(lambda line: line == "step 3", timeout=60)
    first = time.monotonic()
    child.signal(signal.SIGINT)
    child.wait_line(lambda line: line == "saving", timeout=30)
    wait_for(lambda: time.monotonic() - first >= 1.0, 5, "a second to pass")
    sent = time.monotonic()
    child.signal(signal.SIGINT)
    assert child.wait(10) == 1, child.output
    assert time.monotonic() - sent < 1.0
    assert not committed(tmp_path / "ckpt")


def test_sighup_is_a_stop_like_any_other(tmp_path: Path, spawn) -> None:
    child = spawn(train_args(tmp_path))
    child.wait_line(lambda line: line == "step 3", timeout=60)
    child.signal(signal.SIGHUP)
    assert child.wait(30) == 128 + signal.SIGHUP, child.output
    assert committed(tmp_path / "ckpt")


def _ignore_hup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def test_nohup_keeps_sighup_ignored(tmp_path: Path, spawn) -> None:
    child = spawn(train_args(tmp_path), preexec_fn=_ignore_hup)
    child.wait_line(lambda line: line == "step 3", timeout=60)
    child.signal(signal.SIGHUP)
    line = child.wait_line(lambda line: line.startswith("step "), timeout=30)
    reached = int(line.split()[1])
    child.wait_line(lambda line: line == f"step {reached + 20}", timeout=60)
    assert child.proc.poll() is None, "a hang-up stopped a run started under nohup"
    child.signal(signal.SIGTERM)
    assert child.wait(30) == 143, child.output
    assert committed(tmp_path / "ckpt")


@pytest.mark.parametrize("where", ["finally", "atexit"])
def test_a_signal_after_the_commit_keeps_the_documented_exit_code(
    tmp_path: Path, spawn, where: str
) -> None:
    child = spawn(train_args(tmp_path, "--linger", "3"))
    child.wait_line(lambda line: line == "step 3", timeout=60)
    child.signal(signal.SIGTERM)
    child.wait_line(lambda line: line == f"lingering in {where}", timeout=30)
    assert committed(tmp_path / "ckpt")
    child.signal(signal.SIGTERM)  # a supervisor's escalation, SLURM, a second notice
    assert child.wait(30) == 143, child.output


def _odd_run_dirs(tmp_path: Path) -> dict[str, dict[str, str]]:
    regular = tmp_path / "a-file"
    regular.write_text("x")
    record_dir = tmp_path / "record-is-a-dir"
    (record_dir / "record.json").mkdir(parents=True)
    bad_utf8 = tmp_path / "bad-utf8"
    bad_utf8.mkdir()
    (bad_utf8 / "record.json").write_bytes(b'{"state": "\xff\xfe"}')
    return {
        "under-a-file": {"PREEMPTIBLE_RUN_DIR": str(regular / "run")},
        "record-is-a-directory": {"PREEMPTIBLE_RUN_DIR": str(record_dir)},
        "invalid-utf8-record": {"PREEMPTIBLE_RUN_DIR": str(bad_utf8)},
        "attempt-not-an-integer": {
            "PREEMPTIBLE_RUN_DIR": str(tmp_path / "ok"),
            "PREEMPTIBLE_ATTEMPT": "\u00b2",
        },
    }


@pytest.mark.parametrize(
    "case",
    ["under-a-file", "record-is-a-directory", "invalid-utf8-record", "attempt-not-an-integer"],
)
def test_a_run_record_that_cannot_be_written_never_costs_the_checkpoint(
    tmp_path: Path, spawn, case: str
) -> None:
    env = _odd_run_dirs(tmp_path)[case]
    child = spawn(train_args(tmp_path), env=env)
    child.wait_line(lambda line: line == "step 3", timeout=60)
    child.signal(signal.SIGTERM)
    assert child.wait(30) == 143, child.output
    assert committed(tmp_path / "ckpt"), child.output
    finished = subprocess.run(
        [*train_args(tmp_path)[:-4], "--steps", "10"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert finished.returncode == 0, finished.stderr


def test_resume_is_visible_without_any_logging_set_up(tmp_path: Path) -> None:
    args = [*train_args(tmp_path)[:-4], "--steps", "6", "--save-every", "3"]
    first = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    again = subprocess.run(
        [*args[:-4], "--steps", "9", "--save-every", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0, again.stderr
    ckpt = tmp_path / "ckpt" / "step-0000000006.ckpt"
    assert f"preemptible: resumed from {ckpt} at step 6" in again.stderr


def test_handler_uses_the_supervisors_directory_by_default(tmp_path: Path) -> None:
    code = (
        "import torch, preemptible\n"
        "m = torch.nn.Linear(2, 2)\n"
        "h = preemptible.PreemptionCheckpointHandler(None, {'m': m})\n"
        "print(h.checkpoint_dir)\n"
        "h.close()\n"
        "h = preemptible.PreemptionCheckpointHandler('mine', {'m': m})\n"
        "h.close()\n"
        "h = preemptible.PreemptionCheckpointHandler('mine2', {'m': m})\n"
        "h.close()\n"
    )
    supervised = tmp_path / "sup"
    env = {**os.environ, "PREEMPTIBLE_CHECKPOINT_DIR": str(supervised)}
    out = subprocess.run(
        [PY, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(supervised)
    assert out.stderr.count("not to " + str(supervised)) == 1, out.stderr  # warned once
    quiet = subprocess.run(
        [PY, "-c", code],
        cwd=tmp_path,
        env={**env, "PREEMPTIBLE_CHECKPOINT_DIR_DEFAULT": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert quiet.returncode == 0 and "not to" not in quiet.stderr, quiet.stderr


def test_record_names_the_directory_the_handler_really_uses(tmp_path: Path) -> None:
    run_dir = tmp_path / "attempt"
    args = [*train_args(tmp_path)[:-4], "--steps", "3"]
    env = {**os.environ, "PREEMPTIBLE_RUN_DIR": str(run_dir)}
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    record = json.loads((run_dir / "record.json").read_text())
    assert record["checkpoint_dir"] == str((tmp_path / "ckpt").resolve())
    assert record["state"] == "finished"


def test_nohup_supervisor_keeps_sighup_ignored_for_itself_and_the_job(
    tmp_path: Path, spawn
) -> None:
    pid_file = tmp_path / "job.pid"
    sup = spawn(
        [PY, "-m", "preemptible", "run", "--pid-file", str(pid_file), "--", *train_args(tmp_path)],
        cwd=tmp_path,
        preexec_fn=_ignore_hup,
    )
    sup.wait_line(lambda line: line == "step 3", timeout=60)
    trainer = int(pid_file.read_text())
    os.kill(sup.pid, signal.SIGHUP)
    os.kill(trainer, signal.SIGHUP)
    line = sup.wait_line(lambda line: line.startswith("step "), timeout=30)
    reached = int(line.split()[1])
    sup.wait_line(lambda line: line == f"step {reached + 20}", timeout=60)
    assert sup.proc.poll() is None, "a hang-up stopped a run started under nohup"
    os.kill(sup.pid, signal.SIGTERM)
    assert sup.wait(60) == 143, sup.output
    [attempt] = attempts(tmp_path)
    assert attempt["state"] == "PREEMPTED", attempt
