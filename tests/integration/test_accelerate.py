"""The accelerate front end (``preemptible.accelerate.PreemptibleLoop``) under the real
``accelerate launch --multi_gpu --num_processes 2`` (two CPU processes, gloo), on
``tests/scripts/accelerate_train.py``: accelerate's ``examples/by_feature/checkpointing.py``
made tiny (3 epochs of 6 batches a process, dropout, a shuffled loader prepared by accelerate).

Each stop commits ``checkpoint-N`` (``accelerator.save_state``) at the same step on both
processes, and the same command again resumes it (``load_state`` and ``skip_first_batches``,
mid-epoch) to the weights of the same loop run without preemptible, bit for bit. One such run
serves every test (``tests/support/reference.py``).
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, Child, attempts, python_args, supervise
from tests.support.buckets import Bucket
from tests.support.checkpoints import committed, same_weights, temporaries
from tests.support.machines import Machine
from tests.support.reference import DIR, PORT, References, free_port

pytest.importorskip("accelerate")

pytestmark = pytest.mark.timeout(240)

ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
SCRIPT = str(SCRIPTS / "accelerate_train.py")
ENV = {"OMP_NUM_THREADS": "1"}
STEPS = 18  # 3 epochs of 6 batches on each process


def launch(port: str, *args: str) -> list[str]:
    return [
        ACCELERATE,
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--main_process_port",
        port,
        SCRIPT,
        *args,
    ]


REFERENCE = launch(PORT, "--plain", "--weights", f"{DIR}/w.pt")


def job(out: Path, *extra: str) -> list[str]:
    return launch(
        str(free_port()), "--output_dir", str(out), "--weights", str(out / "w.pt"), *extra
    )


def at_step(rank: int, n: int):  # type: ignore[no-untyped-def]
    return lambda line: (m := re.fullmatch(rf"rank {rank} step (\d+)", line)) and int(m[1]) >= n


def stopped_steps(child: Child) -> list[int]:
    """The step each process says it stopped at (searched: the processes share one stream)."""
    return [int(n) for n in re.findall(r"rank \d: stopped at step (\d+)", child.output)]


def resume_exactly(spawn, out: Path, step: int, reference_runs: References) -> None:  # type: ignore[no-untyped-def]
    again = spawn(job(out), env=ENV)
    assert again.wait(180) == 0, again.output
    said = f"resumed from {out / f'checkpoint-{step}'} at step {step}"
    assert again.output.count(said) == 2, again.output  # both processes (lines may run together)
    assert same_weights(reference_runs.result(REFERENCE, ENV) / "w.pt", out / "w.pt"), again.output


def newest_checkpoint(out: Path) -> str:
    """The highest-numbered committed ``checkpoint-N`` (by its number, not its name)."""
    return max(committed(out, "checkpoint-*"), key=lambda name: int(name.split("-")[1]))


def stop_under_preemptible_run(  # type: ignore[no-untyped-def]
    spawn, tmp_path: Path, out: Path, sig: signal.Signals, at: int, *, group: bool = False
) -> int:
    """Run the job under ``preemptible run``, send ``sig`` once rank 0 is at step ``at``: both
    processes stop at one step with its checkpoint, and the supervisor exits 128 + ``sig``.
    ``group``: to the supervisor's whole process group, as a terminal's Ctrl+C; else to the
    supervisor alone, as a platform or ``sbatch --signal`` sends it. The step they stopped at."""
    home = tmp_path / sig.name  # the run's record (a run id of its own: the port differs)
    home.mkdir()
    sup = supervise(
        spawn, home, "--max-preemptions", "0", "--", *job(out, "--sleep", "0.1"), env=ENV
    )
    sup.wait_line(at_step(0, at), timeout=150)
    if group:
        sup.signal_group(sig)
    else:
        sup.signal(sig)  # the supervisor passes it on to the job's group
    assert sup.wait(90) == 128 + sig, sup.output
    [attempt] = attempts(home)
    assert attempt["state"] == "PREEMPTED", sup.output
    steps = stopped_steps(sup)
    assert len(steps) == 2 and steps[0] == steps[1], sup.output
    assert newest_checkpoint(out) == f"checkpoint-{steps[0]}"
    assert temporaries(out) == []
    return steps[0]


def test_sigterm_to_the_launcher_under_preemptible_run_exits_143_and_resumes_exactly(
    reference_runs: References, tmp_path: Path, spawn
) -> None:
    reference_runs.start(REFERENCE, ENV)
    out = tmp_path / "out"
    step = stop_under_preemptible_run(spawn, tmp_path, out, signal.SIGTERM, 8)  # mid-epoch 2
    assert committed(out, "checkpoint-*") == [f"checkpoint-{step}"]
    resume_exactly(spawn, out, step, reference_runs)


def test_ctrl_c_then_sigusr1_under_preemptible_run_exit_130_then_138_and_resume_exactly(
    reference_runs: References, tmp_path: Path, spawn
) -> None:
    """One run through both: Ctrl+C (SIGINT to the foreground group) in the first epoch,
    then, resumed, SIGUSR1 (``sbatch --signal``) in the second; torch's elastic agent passes
    USR1 on only because the supervisor tells it to. The last run ends as the reference."""
    reference_runs.start(REFERENCE, ENV)
    out = tmp_path / "out"
    first = stop_under_preemptible_run(spawn, tmp_path, out, signal.SIGINT, 3, group=True)
    second = stop_under_preemptible_run(spawn, tmp_path, out, signal.SIGUSR1, first + 4)
    assert first < second < STEPS, (first, second)
    resume_exactly(spawn, out, second, reference_runs)


def test_sigkill_with_periodic_saves_then_sigterm_to_one_process_each_resume_exactly(
    reference_runs: References, tmp_path: Path, spawn
) -> None:
    """One run through both: a SIGKILL (no stop, no save) resumes from the last periodic
    checkpoint; that resumed run, signalled on one process alone, stops both at one step
    (mid-epoch); the last run resumes from there and ends exactly as the reference."""
    reference_runs.start(REFERENCE, ENV)
    out = tmp_path / "out"
    periodic = ("--checkpointing_steps", "4", "--sleep", "0.1")
    first = spawn(job(out, *periodic), env=ENV)
    first.wait_line(at_step(0, 6), timeout=150)
    first.kill()  # SIGKILL to the launcher and both processes
    names = committed(out, "checkpoint-*")
    assert names and names[-1] in ("checkpoint-4", "checkpoint-8"), names
    newest = int(names[-1].split("-")[1])

    second = spawn(job(out, *periodic), env=ENV)
    line = second.wait_line(lambda line: line.startswith("rank 1 pid "), timeout=150)
    second.wait_line(at_step(1, newest + 3), timeout=150)
    said = f"resumed from {out / f'checkpoint-{newest}'} at step {newest}"
    assert second.output.count(said) == 2, second.output
    assert temporaries(out) == []  # a temporary left by the kill is gone
    os.kill(int(line.split()[-1]), signal.SIGTERM)  # rank 1 alone; rank 0 learns of it
    assert second.wait(90) == 1, second.output  # torch's elastic agent: a worker exited 143
    steps = stopped_steps(second)
    assert len(steps) == 2 and steps[0] == steps[1], second.output
    assert newest + 3 <= steps[0] < STEPS, second.output
    assert newest_checkpoint(out) == f"checkpoint-{steps[0]}"
    resume_exactly(spawn, out, steps[0], reference_runs)


def test_a_bucket_under_preemptible_run_resumes_on_a_new_machine_exactly(
    reference_runs: References, s3_bucket: Bucket, tmp_path: Path, spawn
) -> None:
    """``preemptible run --checkpoint-dir s3://...`` and ``PreemptibleLoop(accelerator)`` (the
    supervisor's URL). SIGTERM: both processes commit checkpoint-N in the machine's staging and
    it is in the bucket before they exit. On a new machine (the first one's disks gone) the two
    processes, which share that machine's staging, bring it back once, resume from it and end
    exactly as the reference."""
    reference_runs.start(REFERENCE, ENV)
    url = f"{s3_bucket.url}/acc"

    def run_on(machine: Machine, *extra: str) -> Child:
        weights = str(machine.cwd / "w.pt")
        command = launch(str(free_port()), "--output_dir", "", "--weights", weights, *extra)
        args = ("--max-preemptions", "0", "--checkpoint-dir", url, "--", *command)
        return supervise(spawn, machine.cwd, *args, env={**ENV, **machine.env})

    one, two = Machine(tmp_path / "one"), Machine(tmp_path / "two")
    first = run_on(one, "--sleep", "0.1")
    first.wait_line(at_step(0, 8), timeout=150)
    first.signal(signal.SIGTERM)
    assert first.wait(90) == 143, first.output
    steps = stopped_steps(first)
    assert len(steps) == 2 and steps[0] == steps[1], first.output
    step = steps[0]
    uploaded = [k for k in s3_bucket.objects() if k.startswith("acc/manifests/")]
    assert [k.split("/")[2] for k in uploaded] == [f"checkpoint-{step}"], uploaded
    one.gone()

    second = run_on(two)
    assert second.wait(180) == 0, second.output
    assert second.output.count(f"brought checkpoint-{step} back from {url}") == 1, second.output
    resumed = re.findall(rf"resumed from (\S+)/checkpoint-{step} at step {step}", second.output)
    assert len(resumed) == 2 and resumed[0].startswith(str(two.root)), second.output
    [a] = attempts(two.cwd)
    assert a["state"] == "FINISHED", a
    reference = reference_runs.result(REFERENCE, ENV) / "w.pt"
    assert same_weights(reference, two.cwd / "w.pt"), second.output


def test_the_example_s_own_load_state_after_the_loop_resumed_is_named(
    tmp_path: Path, spawn
) -> None:
    """accelerate's example keeps its ``--resume_from_checkpoint`` if the user leaves it on: its
    ``load_state`` after the loop's resume puts that folder's weights at the loop's position,
    which no line said (one process, ``python script.py``)."""
    out = tmp_path / "ckpt"
    args = python_args("accelerate_train.py", "--output_dir", str(out), "--epochs", "1")
    first = spawn(args, env=ENV)
    assert first.wait(120) == 0, first.output
    [name] = committed(out, "checkpoint-*")
    again = spawn([*args, "--resume_from_checkpoint", str(out / name)], env=ENV)
    assert again.wait(120) == 0, again.output
    assert (
        f"preemptible: accelerator.load_state({str(out / name)!r}) after PreemptibleLoop "
        f"resumed from {out / name} at step 12: the weights are now that folder's"
    ) in again.output, again.output
