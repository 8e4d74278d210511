"""The Hugging Face Trainer front end on real Trainer runs in subprocesses, with real signals.

Every stop: the exit code is 128 + signum (143 for a notice), ``checkpoint-N`` is committed
(no temporary left, ``get_last_checkpoint`` finds it), and
``trainer.train(resume_from_checkpoint=get_last_checkpoint(out))`` ends with the same
weights, bit for bit, as a run never stopped (``tests/scripts/hf_train.py``: a 2-layer GPT-2
from a config, dropout 0.1, 12 steps).
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import time
import zipfile
from pathlib import Path

import pytest

from preemptible.stop._signals import DUPLICATE_WINDOW
from tests.conftest import Child, attempts, python_args, read_pid, supervise, wait_for
from tests.support.buckets import Bucket
from tests.support.checkpoints import same_weights, temporaries
from tests.support.machines import Machine
from tests.support.metadata import MetadataServer
from tests.support.reference import DIR, References
from tests.wandb_records import summary

pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(240)

STEPS = 12


def hf_args(out: Path, *extra: str) -> list[str]:
    return python_args("hf_train.py", str(out), "--steps", str(STEPS), *extra)


def step_line(n: int):  # type: ignore[no-untyped-def]
    return lambda line: line == f"step {n}"


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("checkpoint-*"))


def last_checkpoint(out: Path) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    found = get_last_checkpoint(str(out))
    return None if found is None else Path(found).name


REFERENCE = hf_args(Path(DIR) / "out", "--weights", f"{DIR}/w.pt", "--no-callback")


class Reference:
    """The run never stopped (one per session): ``start`` it as a test begins, it runs beside
    the test's own; ``weights`` waits for it and gives its final weights."""

    def __init__(self, runs: References) -> None:
        self.runs = runs

    def start(self) -> None:
        self.runs.start(REFERENCE)

    def weights(self) -> Path:
        return self.runs.result(REFERENCE) / "w.pt"


@pytest.fixture
def reference(reference_runs: References) -> Reference:
    return Reference(reference_runs)


def resume(spawn, out: Path, *extra: str) -> Child:  # type: ignore[no-untyped-def]
    child = spawn(hf_args(out, "--resume", "--weights", str(out / "w.pt"), *extra))
    assert child.wait(180) == 0, child.output
    return child


@pytest.mark.parametrize(
    ("sig", "extra"),
    [
        (signal.SIGTERM, ()),
        (signal.SIGINT, ()),
        (signal.SIGUSR1, ()),
        (signal.SIGTERM, ("--workers", "2")),  # to the whole group: the workers get it too
    ],
    ids=["SIGTERM", "SIGINT", "SIGUSR1", "group-SIGTERM-workers"],
)
def test_signal_at_a_random_step_commits_and_resumes_exactly(
    sig: signal.Signals, extra: tuple[str, ...], reference: Reference, tmp_path: Path, spawn
) -> None:
    reference.start()
    out = tmp_path / "out"
    # at most STEPS - 2: the step under way (at or at + 1) is never the last one, where a stop
    # has nothing left to stop and the run finishes instead (exit 0, no resume to compare:
    # test_a_stop_at_the_last_step_lets_train_return_and_the_run_finish)
    at = random.Random(f"{sig}{extra}").randint(1, STEPS - 2)
    child = spawn(hf_args(out, "--sleep", "0.05", *extra))
    child.wait_line(step_line(at), timeout=120)
    if extra:
        child.signal_group(sig)
    else:
        child.signal(sig)
    assert child.wait(60) == 128 + sig, child.output
    [stopped] = [line for line in child.lines if "stopped at step" in line]
    step = int(stopped.split("stopped at step ")[1].split()[0])
    assert at <= step <= at + 1, child.output  # the step under way when the signal came
    assert checkpoints(out) == [f"checkpoint-{step}"] == [last_checkpoint(out)]
    assert (out / f"checkpoint-{step}" / "trainer_state.json").is_file()
    assert temporaries(out) == []
    # the optimizer's torch.save skipped torch's CRC32 of each record (nothing reads it): the
    # resume below loads it all the same
    with zipfile.ZipFile(out / f"checkpoint-{step}" / "optimizer.pt") as archive:
        records = archive.infolist()
    assert records and all(record.CRC == 0 for record in records)
    again = resume(spawn, out, *extra)
    assert f"preemptible: resumed from {out / f'checkpoint-{step}'} at step {step}" in again.lines
    assert same_weights(reference.weights(), out / "w.pt"), again.output


def test_kill_during_a_save_then_a_second_signal_keep_the_committed_checkpoint(
    reference: Reference, tmp_path: Path, spawn
) -> None:
    reference.start()
    out = tmp_path / "out"
    periodic = ("--save-steps", "4", "--limit", "1")
    # 1. SIGKILL while the Trainer writes checkpoint-8 (the model written, the RNG not yet):
    # checkpoint-4 is the one get_last_checkpoint finds, the torn one is a temporary.
    first = spawn(hf_args(out, *periodic, "--slow-at", "8"))
    first.wait_line(lambda line: line == "saving step 8", timeout=120)
    first.kill()
    assert checkpoints(out) == ["checkpoint-4"] == [last_checkpoint(out)]
    [torn] = temporaries(out)
    assert (torn / "checkpoint-8" / "model.safetensors").is_file()

    # 2. Resumed from checkpoint-4: the torn temporary is removed; a stop whose save (of step
    # 9 or 10) is cut short by a second signal exits 1 at once and leaves checkpoint-8 (the
    # Trainer's own, committed; save_total_limit=1 pruned checkpoint-4 once 8 was in).
    second = spawn(hf_args(out, "--resume", *periodic, "--slow-at", "9", "--sleep", "0.05"))
    second.wait_line(step_line(9), timeout=120)
    assert not torn.exists()
    second.signal(signal.SIGTERM)
    second.wait_line(lambda line: line in ("saving step 9", "saving step 10"), timeout=60)
    took = time.monotonic()
    wait_for(lambda: time.monotonic() - took > DUPLICATE_WINDOW + 0.2, 5, "the duplicate window")
    second.signal(signal.SIGTERM)
    assert second.wait(30) == 1, second.output
    assert checkpoints(out) == ["checkpoint-8"] == [last_checkpoint(out)]

    # 3. Resumed from checkpoint-8: exact.
    resume(spawn, out, *periodic)
    assert same_weights(reference.weights(), out / "w.pt")


def test_a_signal_during_a_periodic_save_stops_at_that_step(tmp_path: Path, spawn) -> None:
    """The Trainer's own checkpoint-8 is being written when SIGTERM comes: once it is committed
    it is the stop's checkpoint; no step more is trained, nothing is saved twice. Run again
    without a resume, the run says that it starts from 0 beside a checkpoint."""
    out = tmp_path / "out"
    slow = ("--save-steps", "4", "--slow-at", "8", "--slow-seconds", "1")
    child = spawn(hf_args(out, *slow))
    child.wait_line(lambda line: line == "saving step 8", timeout=120)
    child.signal(signal.SIGTERM)
    assert child.wait(60) == 143, child.output
    assert "step 9" not in child.lines, child.output
    assert any("stopped at step 8 on SIGTERM" in line for line in child.lines), child.output
    assert checkpoints(out) == ["checkpoint-4", "checkpoint-8"] and temporaries(out) == []
    fresh = spawn(hf_args(out, "--steps", "1"))
    assert fresh.wait(120) == 0, fresh.output
    assert any(
        "training starts at step 0" in line and "checkpoint-8" in line for line in fresh.lines
    ), fresh.output


WINDOW = 8.0  # seconds of notice the fake GCE gives: room for three steps and the saves


def test_gce_notice_trains_on_then_stops_before_the_deadline(
    reference: Reference, tmp_path: Path, spawn
) -> None:
    reference.weights()  # not beside the timed window: it runs first if it must
    out = tmp_path / "out"
    with MetadataServer() as server:
        env = {
            "GCE_METADATA_HOST": server.host,
            "PREEMPTIBLE_GCE_NOTICE_SECONDS": str(WINDOW),
            "PREEMPTIBLE_POLL_INTERVAL": "0.2",
        }
        # 1 s steps: the 10 steps left after the notice outlast its window, and three of them
        # fit in it beside an insurance save of 1 s (a save is that slow on two busy cores)
        child = spawn(hf_args(out, "--sleep", "1.0"), env=env)
        child.wait_line(step_line(2), timeout=120)
        noticed = time.monotonic()
        server.state.gce_preempted = "TRUE"
        assert child.wait(60) == 143, child.output
        exited = time.monotonic()
    lines = child.lines
    first = next(i for i, line in enumerate(lines) if "GCE" in line and "preempt" in line.lower())
    stop = next(i for i, line in enumerate(lines) if re.search(r"at step \d+: .*stopping$", line))
    trained_on = [line for line in lines[first:stop] if line.startswith("step ")]
    assert len(trained_on) >= 3, f"training should go on in the window\n{child.output}"
    assert exited - noticed < WINDOW + 5, child.output
    # the insurance checkpoint at the notice, and the final one, which the resume takes
    [stopped] = [line for line in lines if "stopped at step" in line]
    final = f"checkpoint-{stopped.split('stopped at step ')[1].split()[0]}"
    assert len(checkpoints(out)) == 2 and last_checkpoint(out) == final, child.output
    resume(spawn, out)
    assert same_weights(reference.weights(), out / "w.pt")


def test_exit_false_returns_and_mlflow_run_is_killed_once(tmp_path: Path, spawn) -> None:
    from mlflow.tracking import MlflowClient

    out = tmp_path / "out"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    child = spawn(
        hf_args(out, "--sleep", "0.05", "--return", "--jit", "--report", "mlflow"),
        env={"MLFLOW_TRACKING_URI": uri},
    )
    child.wait_line(step_line(3), timeout=120)
    child.signal(signal.SIGINT)
    assert child.wait(120) == 130, child.output
    # train() returned (exit=False) and the script saw why
    assert "returned after a stop, exit code 130" in child.lines
    # enable_jit_checkpoint is overridden, said once; no second checkpoint of its own
    assert sum("enable_jit_checkpoint=True is overridden" in line for line in child.lines) == 1
    assert len(checkpoints(out)) == 1 and temporaries(out) == []
    run_id = next(line.split()[-1] for line in child.lines if line.startswith("mlflow run"))
    run = MlflowClient(tracking_uri=uri).get_run(run_id)
    assert run.info.status == "KILLED", run.info
    assert run.data.tags["preemptible.status"] == "killed"


def test_wandb_run_of_report_to_is_finished_once_as_preempted(tmp_path: Path, spawn) -> None:
    out = tmp_path / "out"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}
    child = spawn(hf_args(out, "--sleep", "0.05", "--report", "wandb"), env=env)
    child.wait_line(step_line(3), timeout=120)
    child.signal(signal.SIGTERM)
    assert child.wait(120) == 143, child.output
    found = summary(tmp_path)
    assert found["exit_codes"] == [143] and found["preempting"] is True, found


def test_bad_options_say_what_is_valid() -> None:
    from preemptible.frontend import ConfigError
    from preemptible.transformers import PreemptionCallback

    with pytest.raises(ConfigError, match="exit_code=300 is not valid"):
        PreemptionCallback(exit_code=300)
    with pytest.raises(ConfigError, match="tracker='mlflow' is not valid"):
        PreemptionCallback(tracker="mlflow")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown signal 'SIGNOPE'"):
        PreemptionCallback(signals=["SIGNOPE"])


TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
STOPPED = re.compile(r"stopped at step (\d+) on (\S+); checkpoint (\S+); exiting with (\d+)")


def torchrun(out: Path, *extra: str) -> list[str]:
    script = python_args("hf_train.py")[1]
    return [TORCHRUN, "--standalone", "--nproc-per-node", "2", script, str(out), *extra]


@pytest.mark.timeout(300)
def test_torchrun_ranks_stop_at_one_step_and_resume_exactly(
    reference_runs: References, tmp_path: Path, spawn
) -> None:
    """SIGTERM to torchrun, which passes it to both ranks: they agree on one step, both write
    their part of checkpoint-N (each its own RNG state), rank 0 commits, both exit 143; the
    resumed job ends with the weights of a job never stopped."""
    steps = ("--steps", str(STEPS))
    # torchrun --standalone takes a free port of its own: the reference runs beside the job
    ref = torchrun(Path(DIR) / "ref", *steps, "--weights", f"{DIR}/ref.pt")
    reference_runs.start(ref)
    out = tmp_path / "out"
    job = spawn(torchrun(out, *steps, "--sleep", "0.1"))
    job.wait_line(lambda line: "step 4" in line, timeout=120)  # ranks share the pipe
    os.kill(job.pid, signal.SIGTERM)
    job.wait(120)
    stops = STOPPED.findall(job.output)
    assert len(stops) == 2 and len({(s[0], s[2], s[3]) for s in stops}) == 1, job.output
    step, _, path, code = stops[0]
    assert code == "143" and checkpoints(out) == [f"checkpoint-{step}"] == [last_checkpoint(out)]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in Path(path).iterdir()}
    assert temporaries(out) == []
    again = spawn(torchrun(out, *steps, "--resume", "--weights", str(out / "w.pt")))
    assert again.wait(180) == 0, again.output
    assert same_weights(reference_runs.result(ref) / "ref.pt", out / "w.pt"), again.output


def test_under_preemptible_run_a_stop_is_preempted_and_the_restart_resumes_exactly(
    reference: Reference, tmp_path: Path, spawn
) -> None:
    """The job's own SIGTERM (a pod's container, a SLURM step): the attempt is PREEMPTED (the
    run record the callback wrote says so), the supervisor restarts the same command, which
    resumes from checkpoint-N and finishes with the weights of a run never stopped."""
    reference.start()
    out, pid_file = tmp_path / "out", tmp_path / "job.pid"
    job = hf_args(out, "--resume", "--sleep", "0.05", "--weights", str(tmp_path / "w.pt"))
    sup = supervise(spawn, tmp_path, "--pid-file", str(pid_file), "--", *job)
    sup.wait_line(step_line(5), timeout=120)
    os.kill(read_pid(pid_file), signal.SIGTERM)
    assert sup.wait(180) == 0, sup.output
    first, second = attempts(tmp_path)
    assert (first["state"], second["state"]) == ("PREEMPTED", "FINISHED"), (first, second)
    assert any("resumed from" in line and "checkpoint-" in line for line in sup.lines)
    assert same_weights(reference.weights(), tmp_path / "w.pt"), sup.output


def test_a_rerun_of_a_finished_run_trains_nothing_and_keeps_its_results(
    tmp_path: Path, spawn
) -> None:
    """The checkpoint found is the run's last step: the rerun exits 0 at once, with no step
    past the end, no new checkpoint-N, and the first run's train_results.json left as it is
    (the Trainer alone would train step 13 of 12 and write a one-step run's results). The
    first run's log names the checkpoint it saved, not the temporary it was written in."""
    out = tmp_path / "out"
    info = {"TRANSFORMERS_VERBOSITY": "info"}
    first = spawn(hf_args(out, "--save-steps", str(STEPS), "--results", "--resume"), env=info)
    assert first.wait(180) == 0, first.output
    # the Trainer's own line names the checkpoint as committed, not the temporary it writes
    assert f"Saving model checkpoint to {out / f'checkpoint-{STEPS}'}" in first.output
    assert ".tmp-" not in first.output, first.output
    results = (out / "train_results.json").read_bytes()
    assert checkpoints(out) == [f"checkpoint-{STEPS}"]
    again = spawn(hf_args(out, "--save-steps", str(STEPS), "--results", "--resume"))
    assert again.wait(180) == 0, again.output
    assert f"step {STEPS + 1}" not in again.lines and "done" not in again.lines, again.output
    assert f"{out / f'checkpoint-{STEPS}'} is of a finished run" in again.output
    assert checkpoints(out) == [f"checkpoint-{STEPS}"] and temporaries(out) == []
    assert (out / "train_results.json").read_bytes() == results


def test_a_stop_at_the_last_step_lets_train_return_and_the_run_finish(
    reference: Reference, tmp_path: Path, spawn
) -> None:
    """SIGTERM during the run's last step, under ``preemptible run``: nothing is left to stop.
    The last step is committed, train() returns, the code after it runs (the results, the
    weights), the process exits 0 and the run is FINISHED."""
    reference.start()
    out = tmp_path / "out"
    job = hf_args(out, "--signal-at", str(STEPS), "--results", "--weights", str(out / "w.pt"))
    sup = supervise(spawn, tmp_path, "--max-preemptions", "0", "--", *job)
    assert sup.wait(180) == 0, sup.output
    assert f"SIGTERM came at step {STEPS}, the run's last" in sup.output
    assert "done" in sup.lines and (out / "train_results.json").is_file(), sup.output
    [a] = attempts(tmp_path)
    assert (a["state"], a["exit_code"]) == ("FINISHED", 0), a
    assert checkpoints(out) == [f"checkpoint-{STEPS}"] and temporaries(out) == []
    assert same_weights(reference.weights(), out / "w.pt")


def test_a_run_stopped_on_one_machine_resumes_from_the_bucket_on_a_new_one(
    reference: Reference, s3_bucket: Bucket, tmp_path: Path, spawn
) -> None:
    """output_dir stays local, mirror= is a bucket. SIGTERM: checkpoint-N is committed and
    uploaded before the process exits 143. On a new machine (the old one's disks gone) the
    callback, created before the script's get_last_checkpoint, puts checkpoint-N back into the
    new output_dir; the run resumes from it and ends with the weights of a run never stopped."""
    reference.start()
    url = f"{s3_bucket.url}/hf"
    one, two = Machine(tmp_path / "one"), Machine(tmp_path / "two")
    first = spawn(
        hf_args(one.cwd / "out", "--sleep", "0.05", "--mirror", url), cwd=one.cwd, env=one.env
    )
    first.wait_line(step_line(5), timeout=120)
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 143, first.output
    [stopped] = [line for line in first.lines if "stopped at step" in line]
    step = int(stopped.split("stopped at step ")[1].split()[0])
    one.gone()
    out = two.cwd / "out"
    second = spawn(
        hf_args(out, "--resume", "--weights", str(out / "w.pt"), "--mirror", url),
        cwd=two.cwd,
        env=two.env,
    )
    assert second.wait(180) == 0, second.output
    assert f"step {step}" not in second.lines and f"step {step + 1}" in second.lines
    assert same_weights(reference.weights(), out / "w.pt")
