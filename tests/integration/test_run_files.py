"""``preemptible run``'s run directory: ids, one supervisor per run, pid file, heartbeat,
journal, the checkpoint directory it resumes from, and files that cannot be written."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from preemptible._files import write_text_atomic as write_atomic
from tests.conftest import PY, attempts, python_args, supervise

pytestmark = pytest.mark.timeout(90)

FAIL = [PY, "-c", "import sys; sys.exit(3)"]
WAIT = [PY, "-c", "import signal; print('up', flush=True); signal.pause()"]


def runs(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / ".preemptible" / "runs").iterdir())


def test_the_same_command_again_continues_the_same_run(tmp_path: Path, spawn) -> None:
    for expected in (1, 2):
        sup = supervise(spawn, tmp_path, "--", *FAIL)
        assert sup.wait(30) == 3, sup.output
        assert len(attempts(tmp_path)) == expected, sup.output
    [run] = runs(tmp_path)
    assert run.startswith("python-")  # no script: the program's name
    assert f"run {run} (from the working directory" in sup.output
    assert "a rerun of the same command continues this run" in sup.output
    assert (tmp_path / ".preemptible" / "runs" / run / "attempt-2").is_dir()
    other = supervise(spawn, tmp_path, "--", PY, "-c", "import sys; sys.exit(4)")
    assert other.wait(30) == 4
    assert len(runs(tmp_path)) == 2  # another command is another run


def test_the_run_id_follows_the_checkpoint_directory(tmp_path: Path, spawn) -> None:
    first = supervise(spawn, tmp_path, "--checkpoint-dir", "ck", "--", *FAIL)
    assert first.wait(30) == 3
    second = supervise(spawn, tmp_path, "--checkpoint-dir", "./ck/", "--", PY, "-c", "pass")
    assert second.wait(30) == 0
    [run] = runs(tmp_path)
    assert run.startswith("ck-"), run
    assert [a["state"] for a in attempts(tmp_path)] == ["FAILED", "FINISHED"]
    assert f"(from the checkpoint directory {tmp_path / 'ck'})" in second.output


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SLURM_JOB_ID": "/../../x"}, "SLURM_JOB_ID"),
        ({"SLURM_JOB_ID": "4242\n"}, "4242"),
        ({"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "../../x", "SLURM_JOB_ID": "8"}, "x"),
    ],
)
def test_every_id_that_becomes_a_path_is_checked(
    env: dict[str, str], message: str, tmp_path: Path, spawn
) -> None:
    home = tmp_path / "a" / "b"
    sup = supervise(spawn, tmp_path, "--home", str(home), "--", "touch", "started", env=env)
    assert sup.wait(30) == 2, sup.output
    [line] = sup.lines
    assert message in line and "not valid" in line and "Traceback" not in sup.output
    assert not (tmp_path / "started").exists()
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) in ([], ["a"])


def test_one_supervisor_per_run(tmp_path: Path, spawn) -> None:
    fds = (
        "import os; print('FDS', [os.readlink(f'/proc/self/fd/{fd}') "
        "for fd in os.listdir('/proc/self/fd') if os.path.exists(f'/proc/self/fd/{fd}')], "
        "flush=True); import signal; print('up', flush=True); signal.pause()"
    )
    first = supervise(spawn, tmp_path, "--run-id", "exp", "--", PY, "-c", fds)
    first.wait_line(
        lambda line: line.startswith("up"), timeout=30
    )  # a log line may land before its "\n"
    assert "supervisor.lock" not in first.output  # the job does not inherit the lock
    second = supervise(spawn, tmp_path, "--run-id", "exp", "--", "touch", "started")
    assert second.wait(30) == 2, second.output
    [line] = second.lines
    assert f"run exp is already supervised by pid {first.pid}" in line
    assert not (tmp_path / "started").exists()
    first.signal(signal.SIGTERM)
    assert first.wait(30) == 143
    third = supervise(spawn, tmp_path, "--run-id", "exp", "--", "touch", "started")
    assert third.wait(30) == 0, third.output  # the lock went with the first supervisor
    assert [a["attempt"] for a in attempts(tmp_path)] == [1, 2]


def test_pid_file_in_a_missing_directory_fails_before_the_job_starts(tmp_path: Path, spawn) -> None:
    sup = supervise(spawn, tmp_path, "--pid-file", "/nodir/p", "--", "touch", "started")
    assert sup.wait(30) == 2, sup.output
    [line] = sup.lines
    assert "--pid-file /nodir/p: cannot write in /nodir" in line
    assert not (tmp_path / "started").exists()


def test_pid_file_is_left_alone_when_someone_else_took_it(tmp_path: Path, spawn) -> None:
    pid_file = tmp_path / "job.pid"
    job = (
        "import os, sys, time; p = sys.argv[1]\n"
        "while not (os.path.exists(p) and open(p).read()):\n"
        "    time.sleep(0.01)  # written just after the start\n"
        "assert open(p).read() == f'{os.getpid()}\\n'\n"
        "open(p, 'w').write('other\\n')\n"
    )
    sup = supervise(spawn, tmp_path, "--pid-file", str(pid_file), "--", PY, "-c", job, pid_file)
    assert sup.wait(30) == 0, sup.output
    assert pid_file.read_text() == "other\n"
    sup = supervise(spawn, tmp_path, "--pid-file", str(pid_file), "--", PY, "-c", "pass")
    assert sup.wait(30) == 0, sup.output
    assert not pid_file.exists()  # ours: removed


def test_atomic_writes_do_not_follow_a_planted_temp_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "job.pid"
    for name in (f".{target.name}.{os.getpid()}.tmp", f".{target.name}.tmp", f"{target}.tmp"):
        (tmp_path / Path(name).name).symlink_to(victim)
    write_atomic(target, "123\n")
    assert target.read_text() == "123\n" and victim.read_text() == "precious"
    target.unlink()
    target.symlink_to(victim)  # a link at the name itself is replaced, not written through
    write_atomic(target, "456\n")
    assert not target.is_symlink() and victim.read_text() == "precious"


def test_heartbeat_says_ended_after_the_run(tmp_path: Path, spawn) -> None:
    sup = supervise(spawn, tmp_path, "--run-id", "exp", "--", *FAIL)
    assert sup.wait(30) == 3
    beat = json.loads((tmp_path / ".preemptible" / "runs" / "exp" / "heartbeat.json").read_text())
    assert beat["state"] == "ended" and beat["run_state"] == "FAILED" and beat["exit_code"] == 3
    assert beat["pid"] == sup.pid


def test_files_that_cannot_be_written_are_warnings(tmp_path: Path, spawn) -> None:
    # the job replaces the journal and the heartbeat with directories: neither can be written
    job = (
        "import os, pathlib, sys; run = pathlib.Path(os.environ['PREEMPTIBLE_RUN_DIR']).parent; "
        "[((run / n).unlink(missing_ok=True), (run / n / 'x').mkdir(parents=True)) "
        "for n in ('attempts.jsonl', 'heartbeat.json') if not (run / n).is_dir()]; sys.exit(3)"
    )
    sup = supervise(spawn, tmp_path, "--run-id", "exp", "--max-failures", "1", "--", PY, "-c", job)
    assert sup.wait(30) == 3, sup.output
    assert "Traceback" not in sup.output
    assert sup.output.count("attempts.jsonl (Is a directory); the run goes on") == 1
    assert sup.output.count("heartbeat.json (Is a directory); the run goes on") == 1
    assert sup.output.count("FAILED (exit 3)") == 2  # the restart happened all the same


def test_a_failed_start_leaves_no_attempt_directory(tmp_path: Path, spawn) -> None:
    sup = supervise(spawn, tmp_path, "--run-id", "exp", "--", "/nonexistent/prog")
    assert sup.wait(30) == 2, sup.output
    assert not list((tmp_path / ".preemptible" / "runs" / "exp").glob("attempt-*"))


def test_preemption_budget_message(tmp_path: Path, spawn) -> None:
    args = ["--max-preemptions", "2", "--", *python_args("ending.py", "start", "exit3")]
    sup = supervise(spawn, tmp_path, *args)
    assert sup.wait(60) == 143, sup.output
    assert len(attempts(tmp_path)) == 3
    assert "preempted 3 times; --max-preemptions is 2; giving up" in sup.output


def test_help_lists_every_exit_code(tmp_path: Path, spawn) -> None:
    sup = spawn([PY, "-m", "preemptible", "run", "--help"], cwd=tmp_path)
    assert sup.wait(30) == 0
    for state in ("FINISHED", "PREEMPTED", "FAILED", "KILLED", "CRASHED"):
        assert state in sup.output


CKPT_JOB = """
import os, pathlib, sys
from preemptible import _run
print('DEFAULT', os.environ.get('PREEMPTIBLE_CHECKPOINT_DIR_DEFAULT'), flush=True)
print('RESUME', os.environ.get('PREEMPTIBLE_RESUME_FROM'), flush=True)
own = pathlib.Path(sys.argv[1]).resolve()
own.mkdir(exist_ok=True)
_run.update_record(checkpoint_dir=sys.argv[2] if len(sys.argv) > 2 else str(own))
if os.environ['PREEMPTIBLE_ATTEMPT'] == '1':
    (own / 'step-5.ckpt').write_bytes(b'x')
    _run.update_record(state='stopped', preempting=True, signum=15, step=5)
    sys.exit(143)
"""


def test_the_next_attempt_resumes_from_where_the_job_saves(tmp_path: Path, spawn) -> None:
    sup = supervise(spawn, tmp_path, "--", PY, "-c", CKPT_JOB, "own")
    assert sup.wait(60) == 0, sup.output
    assert [line for line in sup.lines if line.startswith(("RESUME", "DEFAULT"))] == [
        "DEFAULT 1",
        "RESUME None",
        "DEFAULT 1",
        f"RESUME {tmp_path / 'own' / 'step-5.ckpt'}",
    ]
    assert f"the job keeps its checkpoints in {tmp_path / 'own'}" in sup.output


def test_a_job_with_its_own_directory_leaves_no_empty_one_and_is_said_once_per_run(
    tmp_path: Path, spawn
) -> None:
    """The run's checkpoints/ the job never used is not left behind empty, and "the job keeps
    its checkpoints in ..." is said once for the run, not again by the same command rerun."""
    job = ("--", PY, "-c", CKPT_JOB, "own")
    first = supervise(spawn, tmp_path, *job)
    assert first.wait(60) == 0, first.output
    [run_id] = runs(tmp_path)
    run_dir = tmp_path / ".preemptible" / "runs" / run_id
    assert not (run_dir / "checkpoints").exists(), sorted(p.name for p in run_dir.iterdir())
    said = [line for line in first.lines if "keeps its checkpoints" in line]
    assert len(said) == 1, first.output
    again = supervise(spawn, tmp_path, *job)
    assert again.wait(60) == 0, again.output
    assert not any("keeps its checkpoints" in line for line in again.lines), again.output
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize("claimed", ["relative/dir", "/nonexistent/dir", "{own}/step-5.ckpt"])
def test_a_checkpoint_dir_that_is_not_a_directory_is_not_trusted(
    claimed: str, tmp_path: Path, spawn
) -> None:
    claimed = claimed.format(own=tmp_path / "own")
    args = ["--checkpoint-dir", "ck", "--", PY, "-c", CKPT_JOB, "own", claimed]
    sup = supervise(spawn, tmp_path, *args)
    assert sup.wait(60) == 0, sup.output
    assert [line for line in sup.lines if line.startswith(("RESUME", "DEFAULT"))] == [
        "DEFAULT None",
        "RESUME None",
        "DEFAULT None",
        "RESUME None",
    ]


def test_demo_workdir_that_cannot_be_used(tmp_path: Path, spawn) -> None:
    pytest.importorskip("torch")
    sup = spawn([PY, "-m", "preemptible", "demo", "--workdir", "/proc/x"], cwd=tmp_path)
    assert sup.wait(60) == 2, sup.output
    [line] = sup.lines
    assert line.startswith("preemptible: cannot use /proc/x for the demo")


TORCHRUN_LIKE = """
import os, pathlib, sys
from preemptible import _run
own = pathlib.Path('own').resolve()
own.mkdir(exist_ok=True)
_run.update_record(checkpoint_dir=str(own))
if os.environ['PREEMPTIBLE_ATTEMPT'] == '1':
    (own / 'step-5.ckpt').write_bytes(b'x')
    _run.update_record(state='stopped', preempting=True, signum=15, step=5,
                       checkpoint=str(own / 'step-5.ckpt'))
    sys.exit(1)  # as torchrun does once its workers saved and exited 143
_run.update_record(state='finished', step=9)
"""


def test_each_attempt_line_says_the_state_the_jobs_exit_code_and_what_comes_next(
    tmp_path: Path, spawn
) -> None:
    """One exit code per line: the job's in the attempt's line, the supervisor's in the line
    that ends the run; nothing about a next attempt after FINISHED; the same checkpoint
    directory spelled two ways (relative, absolute) is not news."""
    args = ["--checkpoint-dir", "own", "--max-preemptions", "0", "--", PY, "-c", TORCHRUN_LIKE]
    first = supervise(spawn, tmp_path, *args)
    assert first.wait(60) == 143, first.output
    mine = [line.split(" preemptible: ", 1)[1] for line in first.lines if " preemptible: " in line]
    ckpt = tmp_path / "own" / "step-5.ckpt"
    attempt = next(line for line in mine if line.startswith("attempt 1:"))
    assert re.fullmatch(
        rf"attempt 1: PREEMPTED \(exit 1\) after [\d.]+ s, pid \d+, stopped at step 5, "
        rf"checkpoint {re.escape(str(ckpt))}",
        attempt,
    ), attempt
    run_id = runs(tmp_path)[0]
    assert mine[-1] == (
        f"run {run_id} ends PREEMPTED, exit code 143; the same command again resumes it "
        "from step-5.ckpt"
    ), first.output
    assert not any("keeps its checkpoints" in line for line in mine), first.output

    second = supervise(spawn, tmp_path, *args)
    assert second.wait(60) == 0, second.output
    mine = [line.split(" preemptible: ", 1)[1] for line in second.lines if " preemptible: " in line]
    # the run's last line: FINISHED, and not a word about what a next attempt would do
    assert re.fullmatch(r"attempt 2: FINISHED \(exit 0\) after [\d.]+ s, pid \d+", mine[-1]), (
        second.output
    )


FINISHED_THEN_WAITS = """
import pathlib, signal
from preemptible import _run
own = pathlib.Path('own').resolve()
own.mkdir(exist_ok=True)
(own / 'step-20.ckpt').write_bytes(b'x')
_run.update_record(checkpoint_dir=str(own), state='finished', step=20)
print('trained', flush=True)  # the loop is over, the handler gone: SIGTERM kills now
signal.pause()
"""


def test_a_stop_after_training_finished_says_the_training_is_committed(
    tmp_path: Path, spawn
) -> None:
    sup = supervise(spawn, tmp_path, "--checkpoint-dir", "own", "--", PY, "-c", FINISHED_THEN_WAITS)
    sup.wait_line(lambda line: line == "trained", timeout=30)
    sup.signal(signal.SIGTERM)
    assert sup.wait(60) == 143, sup.output
    assert re.search(
        r"attempt 1: PREEMPTED \(killed by SIGTERM\) after [\d.]+ s, pid \d+; its training had "
        r"finished at step 20, checkpoint step-20\.ckpt",
        sup.output,
    ), sup.output
    assert sup.lines[-1].endswith("the same command again resumes it from step-20.ckpt")
