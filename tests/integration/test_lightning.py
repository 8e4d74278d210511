"""GracefulInterruptCallback in real Lightning fits on CPU, real signals, subprocesses."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preemptible.stop._signals import DUPLICATE_WINDOW
from tests.conftest import attempts, supervise, wait_for
from tests.support.buckets import Bucket
from tests.support.checkpoints import fit_args, same_weights
from tests.support.machines import Machine
from tests.support.reference import DIR, PORT, References
from tests.wandb_records import summary

pytestmark = pytest.mark.timeout(240)


def batch_line(epoch: int, batch: int):  # type: ignore[no-untyped-def]
    return lambda line: line == f"batch {epoch} {batch}"


KINDS = {"plain": [], "val": ["--val"], "shuffle": ["--shuffle"]}


class Reference:
    """The uninterrupted fit of each kind (one per session, shared with the other Lightning
    tests): ``start`` it as a test begins, it runs beside the test's own fits; ``weights``
    waits for it. The fits compared with it differ only in what does not change the weights
    (sleeps, the signal, the resume)."""

    def __init__(self, runs: References) -> None:
        self.runs = runs

    def start(self, kind: str) -> None:
        self.runs.start(fit_args(Path(DIR), *KINDS[kind]))

    def weights(self, kind: str) -> Path:
        return self.runs.result(fit_args(Path(DIR), *KINDS[kind])) / "o.pt"


@pytest.fixture
def references(reference_runs: References) -> Reference:
    return Reference(reference_runs)


def val_sleep_from(epoch: int, batch: int) -> list[str]:
    """Validations sleep (1 s a batch with --step-sleep) from the one due after this batch
    on: where the stop lands they are as slow as before, the earlier ones take no time."""
    return ["--val-sleep-from", str(12 * epoch + batch + 1)]


@pytest.mark.parametrize(
    ("epoch", "batch", "kind"),
    [
        (1, 5, "plain"),
        (1, 0, "plain"),
        (1, 11, "plain"),
        (0, 3, "val"),
        (1, 7, "val"),
        (1, 6, "shuffle"),
    ],
    ids=[
        "mid-epoch",
        "first-batch",
        "last-batch",
        "validation-due",
        "validation-due-2",
        "shuffled",
    ],
)
def test_interrupt_then_resume_is_bit_exact(
    epoch: int, batch: int, kind: str, references: Reference, tmp_path: Path, spawn
) -> None:
    references.start(kind)
    first = spawn(
        fit_args(tmp_path, "--step-sleep", "0.05", *val_sleep_from(epoch, batch), *KINDS[kind])
    )
    first.wait_line(batch_line(epoch, batch), timeout=120)
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 0, first.output
    assert (tmp_path / "resume.ckpt").exists()
    assert "later train-end hook ran" not in first.output
    second = spawn(fit_args(tmp_path, "--resume", *KINDS[kind]))
    assert second.wait(180) == 0, second.output
    assert second.lines.count(f"batch {epoch} {batch}") == 0, "a trained batch was replayed"
    assert same_weights(references.weights(kind), tmp_path / "o.pt")


@pytest.mark.timeout(300)
def test_a_finished_resumed_fit_run_again_trains_nothing_and_says_so(
    references: Reference, tmp_path: Path, spawn
) -> None:
    """The README's recipe run once more after the resumed fit finished: resume.ckpt holds the
    finished fit (not the stop's), so Lightning trains 0 batches; the weights stay those of the
    uninterrupted fit and no ModelCheckpoint/epoch-end work runs again."""
    references.start("plain")
    first = spawn(fit_args(tmp_path, "--step-sleep", "0.05", "--exit-code", "0"))
    first.wait_line(batch_line(1, 6), timeout=120)
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 0, first.output
    second = spawn(fit_args(tmp_path, "--resume"))
    assert second.wait(180) == 0, second.output
    assert "batch 2 11" in second.lines
    assert same_weights(references.weights("plain"), tmp_path / "o.pt")
    again = spawn(fit_args(tmp_path, "--resume"))
    assert again.wait(180) == 0, again.output
    assert [line for line in again.lines if line.startswith("batch ")] == [], again.output
    assert "resume.ckpt is of a finished run; nothing left to train" in again.output
    assert same_weights(references.weights("plain"), tmp_path / "o.pt")


def test_the_default_exit_code_tells_a_scheduler_the_fit_was_stopped(tmp_path: Path, spawn) -> None:
    """Without exit_code= the process exits 128 + signum (a retry loop, SLURM or Kubernetes
    reads it as a stop, not as done), and the supervisor agrees."""
    child = spawn(fit_args(tmp_path, "--step-sleep", "0.05", "--exit-code", "default"))
    child.wait_line(batch_line(0, 3), timeout=120)
    child.signal(signal.SIGUSR1)
    assert child.wait(60) == 128 + signal.SIGUSR1, child.output
    assert (tmp_path / "resume.ckpt").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["plain", "val"])
def test_a_stop_on_the_last_batch_then_one_in_the_next_epoch_resumes_exactly(
    kind: str, references: Reference, tmp_path: Path, spawn
) -> None:
    """The fit resumed after epoch 1's last batch counts epoch 2 as started (as an
    uninterrupted fit does), so a checkpoint taken in epoch 2 resumes mid-epoch, not as if
    epoch 2 were about to start again."""
    references.start(kind)
    first = spawn(fit_args(tmp_path, "--step-sleep", "0.05", *val_sleep_from(1, 11), *KINDS[kind]))
    first.wait_line(batch_line(1, 11), timeout=120)
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 0, first.output
    second = spawn(
        fit_args(tmp_path, "--step-sleep", "0.05", "--resume", *val_sleep_from(2, 5), *KINDS[kind])
    )
    second.wait_line(batch_line(2, 5), timeout=120)
    second.signal(signal.SIGTERM)
    assert second.wait(60) == 0, second.output
    third = spawn(fit_args(tmp_path, "--resume", *KINDS[kind]))
    assert third.wait(180) == 0, third.output
    assert third.lines.count("batch 2 5") == 0, "a trained batch was replayed"
    assert "batch 2 6" in third.lines
    assert same_weights(references.weights(kind), tmp_path / "o.pt")


def test_contract_on_ctrl_c_to_the_group(tmp_path: Path, spawn) -> None:
    child = spawn(fit_args(tmp_path, "--step-sleep", "0.05"))
    child.wait_line(batch_line(0, 4), timeout=120)
    child.signal_group(signal.SIGINT)
    assert child.wait(60) == 0, child.output  # the contract's default exit code
    out = child.output
    assert "INFO Added GracefulInterrupt callback" in out
    assert f"saving {tmp_path}/resume.ckpt" in out
    assert re.search(r"preemptible: stopped at step \d+ on SIGINT; .*; exiting with 0", out)
    assert "later train-end hook ran" not in out
    assert "KeyboardInterrupt" not in out


def test_sigterm_skips_a_due_validation(tmp_path: Path, spawn) -> None:
    # the signal must land inside batch 3: 0.5 s batches leave room on a loaded machine
    child = spawn(fit_args(tmp_path, "--step-sleep", "0.5", "--val"))
    child.wait_line(batch_line(0, 3), timeout=120)  # validation (2 s) is due after this batch
    child.signal(signal.SIGTERM)
    assert child.wait(60) == 0, child.output
    # the due validation did not run (fit.py prints "val N" as a pass starts); how long the
    # way out takes is measured in benchmarks/bench_lightning_exit.py, not asserted here
    assert "val 0" not in child.lines
    assert (tmp_path / "resume.ckpt").exists()


def test_group_sigterm_with_workers(tmp_path: Path, spawn) -> None:
    child = spawn(fit_args(tmp_path, "--step-sleep", "0.05", "--workers", "2"))
    child.wait_line(batch_line(0, 5), timeout=120)
    child.signal_group(signal.SIGTERM)
    assert child.wait(60) == 0, child.output
    assert "killed by signal" not in child.output
    assert (tmp_path / "resume.ckpt").exists()


def test_second_signal_during_the_save_exits_1_at_once(tmp_path: Path, spawn) -> None:
    child = spawn(fit_args(tmp_path, "--step-sleep", "0.05", "--slow-save", "30"))
    child.wait_line(batch_line(0, 3), timeout=120)
    child.signal(signal.SIGINT)
    child.wait_line(lambda line: line == "saving", timeout=30)
    # a person's second signal, not the same stop delivered twice: "saving" shows the first
    # was taken, so a second after DUPLICATE_WINDOW from here is a new one
    took = time.monotonic()
    wait_for(lambda: time.monotonic() - took > DUPLICATE_WINDOW + 0.2, 5, "the duplicate window")
    sent = time.monotonic()
    child.signal(signal.SIGINT)
    assert child.wait(10) == 1, child.output
    assert time.monotonic() - sent < 1.0


def test_exit_code_option_and_run_record(tmp_path: Path, spawn) -> None:
    sup = supervise(
        spawn, tmp_path, "--max-preemptions", "0", "--", *fit_args(tmp_path, "--step-sleep", "0.05")
    )
    sup.wait_line(batch_line(0, 4), timeout=120)
    sup.signal(signal.SIGTERM)
    assert sup.wait(60) == 143, sup.output  # the fit exits 0, the record says preempted
    [a] = attempts(tmp_path)
    assert a["state"] == "PREEMPTED" and a["ending"] == "exit 0"
    # the callback's record says where it saves and what to resume from, as the handler's
    [record] = [json.loads(p.read_text()) for p in tmp_path.rglob("attempt-1/record.json")]
    assert record["checkpoint_dir"] == str(tmp_path.resolve())
    assert record["resume_from"] == str((tmp_path / "resume.ckpt").resolve())
    assert record["state"] == "stopped"
    listing = subprocess.run(
        [sys.executable, "-m", "preemptible", "runs", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listing.returncode == 0, listing.stderr
    [run] = json.loads(listing.stdout)
    assert run["checkpoint"] == str((tmp_path / "resume.ckpt").resolve())  # not "none"
    child = spawn(fit_args(tmp_path / "b", "--step-sleep", "0.05", "--exit-code", "signal"))
    child.wait_line(batch_line(0, 4), timeout=120)
    child.signal(signal.SIGTERM)
    assert child.wait(60) == 143, child.output


def test_slurm_usr1_under_preemptible_run_checkpoints_with_the_default_signals(
    references: Reference, tmp_path: Path, spawn
) -> None:
    """The README's SLURM recipe: ``sbatch --signal=B:USR1@120`` to ``exec preemptible run``,
    which passes USR1 on to the fit. Under the callback's defaults the fit saves at the batch
    boundary and exits with its exit code (0), the run is recorded PREEMPTED (not CRASHED by
    signal 10), and the resumed fit ends with the reference weights."""
    references.start("plain")
    sup = supervise(
        spawn, tmp_path, "--max-preemptions", "0", "--", *fit_args(tmp_path, "--step-sleep", "0.05")
    )
    sup.wait_line(batch_line(0, 4), timeout=120)
    sup.signal(signal.SIGUSR1)
    assert sup.wait(60) == 128 + signal.SIGUSR1, sup.output
    [a] = attempts(tmp_path)
    assert a["state"] == "PREEMPTED" and a["ending"] == "exit 0", a
    assert "preemptible: SIGUSR1 at step" in sup.output and ", then stopping" in sup.output
    assert re.search(r"stopped at step \d+ on \S+; .*; exiting with 0", sup.output)
    assert "later train-end hook ran" not in sup.output
    resumed = spawn(fit_args(tmp_path, "--resume"))
    assert resumed.wait(180) == 0, resumed.output
    assert same_weights(references.weights("plain"), tmp_path / "o.pt")


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGHUP])
def test_usr2_and_hup_stop_a_fit_with_their_own_exit_codes(
    sig: signal.Signals, tmp_path: Path, spawn
) -> None:
    child = spawn(fit_args(tmp_path, "--step-sleep", "0.05", "--exit-code", "signal"))
    child.wait_line(batch_line(0, 4), timeout=120)
    child.signal(sig)
    assert child.wait(60) == 128 + sig, child.output
    assert (tmp_path / "resume.ckpt").exists()
    assert f"preemptible: {sig.name} at step" in child.output, child.output


@pytest.mark.parametrize("tracker", ["local", "mlflow", "wandb"])
def test_tracker_finalized_once_with_the_truth(tracker: str, tmp_path: Path, spawn) -> None:
    child = spawn(
        fit_args(tmp_path, "--step-sleep", "0.05", "--tracker", tracker),
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    child.wait_line(batch_line(0, 4), timeout=120)
    child.signal(signal.SIGTERM)
    assert child.wait(120) == 0, child.output
    if tracker == "local":
        events = [
            json.loads(line) for line in (tmp_path / "tracker.jsonl").read_text().splitlines()
        ]
        assert [(e["event"], e.get("status")) for e in events] == [
            ("checkpoint", None),
            ("finalize", "preempted"),
        ]
    elif tracker == "mlflow":
        from mlflow.tracking import MlflowClient

        run_id = next(line.split()[-1] for line in child.lines if line.startswith("mlflow run"))
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
        run = client.get_run(run_id)
        assert run.info.status == "KILLED"
        assert run.data.tags["preemptible.status"] == "preempted"
        assert [a.path for a in client.list_artifacts(run_id, "checkpoints")] == [
            "checkpoints/resume.ckpt"
        ]
    else:
        found = summary(tmp_path)
        assert found["exit_codes"] == [143] and found["preempting"] is True


# Loaded by every rank (PYTHONPATH): prefixes each preemptible log line with the pid that
# logged it, so the test can tell the ranks' lines apart in their shared output.
PID_LOGS = """\
import logging
import os

_make = logging.getLogRecordFactory()


def _record(*args, **kwargs):
    record = _make(*args, **kwargs)
    if record.name == "preemptible":
        record.msg = f"[pid {os.getpid()}] {record.msg}"
    return record


logging.setLogRecordFactory(_record)
"""
SAVE = re.compile(r"\[pid (\d+)\] preemptible: (?:rank \d: )?[\w-]+ at step (\d+): saving \S+")
EXIT = re.compile(
    r"\[pid (\d+)\] preemptible: (?:rank \d: )?stopped at step \d+ on \S+; .*; exiting with 0"
)


def stops_by_rank(output: str, pids: dict[str, int]) -> dict[str, int]:
    """rank -> the global step it saved at; fails unless each rank saved once and exited."""
    saves: dict[int, list[int]] = {}
    for pid, step in SAVE.findall(output):
        saves.setdefault(int(pid), []).append(int(step))
    exits = {int(pid) for pid in EXIT.findall(output)}
    out = {}
    for rank, pid in sorted(pids.items()):
        assert len(saves.get(pid, [])) == 1, f"rank {rank} (pid {pid}) saved {saves.get(pid)}"
        assert pid in exits, f"rank {rank} (pid {pid}) did not log its exit"
        out[rank] = saves[pid][0]
    assert set(saves) <= set(pids.values()), f"saves from unknown processes: {saves}"
    return out


@pytest.mark.timeout(420)
def test_a_ddp_fit_resumed_in_a_later_epoch_draws_that_epochs_order(
    reference_runs: References, tmp_path: Path, spawn
) -> None:
    """DistributedSampler permutes by epoch (Lightning sets it at each epoch's start). The
    iterator a mid-epoch resume recreates must be drawn for the resumed epoch, not epoch 0:
    the resumed fit ends with the weights of the uninterrupted one, bit for bit."""
    args = ["--devices", "2", "--epochs", "2", "--shuffle"]
    reference = (fit_args(Path(DIR), *args), {"MASTER_PORT": PORT})
    reference_runs.start(*reference)
    d = tmp_path / "run"
    first = spawn(fit_args(d, *args, "--step-sleep", "0.05"), env={"MASTER_PORT": "29411"})
    first.wait_line(lambda line: "batch 1 2" in line, timeout=180)  # both ranks share the pipe
    first.signal(signal.SIGTERM)
    assert first.wait(120) == 0, first.output
    second = spawn(fit_args(d, *args, "--resume"), env={"MASTER_PORT": "29412"})
    assert second.wait(240) == 0, second.output
    assert same_weights(reference_runs.result(*reference) / "o.pt", d / "o.pt")


def test_ddp_signal_to_one_rank_stops_both_at_the_same_batch(tmp_path: Path, spawn) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PID_LOGS)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    for target in (0, 1):
        d = tmp_path / f"rank{target}"
        child = spawn(
            fit_args(d, "--step-sleep", "0.05", "--devices", "2", "--epochs", "20"),
            env={"MASTER_PORT": str(29400 + target), "PYTHONPATH": path},
        )
        pids = {}
        for _ in range(2):
            line = child.wait_line(
                lambda line, seen=pids: line.startswith("rank ") and line.split()[1] not in seen,
                timeout=120,
            )
            pids[line.split()[1]] = int(line.split()[3])
        # both ranks print to one pipe, so lines can run together: match a substring
        child.wait_line(lambda line: "batch 0 4" in line, timeout=120)
        os.kill(pids[str(target)], signal.SIGTERM)
        assert child.wait(120) == 0, child.output
        # every line of a multi-rank run names its rank: which one got the signal, who stopped
        assert f"preemptible: rank {target}: received SIGTERM" in child.output, child.output
        for rank in (0, 1):
            assert re.search(rf"preemptible: rank {rank}: stopped at step", child.output)
        steps = stops_by_rank(child.output, pids)
        assert steps["0"] == steps["1"], f"ranks stopped at different steps: {steps}"
        assert (d / "resume.ckpt").exists()


INSURANCE = re.compile(
    r"\[pid (\d+)\] preemptible: (?:rank \d: )?insurance checkpoint \S+ at step (\d+)"
)
STOP_FILE_PER_RANK = """
import os
_rank = os.environ.get("LOCAL_RANK", "0")
os.environ["PREEMPTIBLE_STOP_FILE"] = os.environ["STOP_FILE_BASE"] + _rank
"""


def test_ddp_notice_to_one_rank_insurance_and_stop_at_the_same_batch(tmp_path: Path, spawn) -> None:
    """A notice with a grace window seen by rank 1 only: both ranks take the insurance
    checkpoint after the same batch, train on, and stop after the same batch."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PID_LOGS + STOP_FILE_PER_RANK)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    d = tmp_path / "run"
    base = str(tmp_path / "stop-rank")
    child = spawn(
        fit_args(d, "--step-sleep", "0.05", "--devices", "2", "--epochs", "60"),
        env={
            "MASTER_PORT": "29410",
            "PYTHONPATH": path,
            "STOP_FILE_BASE": base,
            "PREEMPTIBLE_GRACE_PERIOD": "12",  # 7 s: notices.EXIT_MARGIN is 5
        },
    )
    pids: dict[str, int] = {}
    for _ in range(2):
        line = child.wait_line(
            lambda line, seen=pids: line.startswith("rank ") and line.split()[1] not in seen,
            timeout=120,
        )
        pids[line.split()[1]] = int(line.split()[3])
    child.wait_line(lambda line: "batch 0 4" in line, timeout=120)
    Path(base + "1").write_text("")
    assert child.wait(120) == 0, child.output
    insured: dict[int, list[int]] = {}
    for pid, step in INSURANCE.findall(child.output):
        insured.setdefault(int(pid), []).append(int(step))
    assert sorted(insured) == sorted(pids.values()), f"insurance by rank: {insured}"
    assert insured[pids["0"]] == insured[pids["1"]], f"insurance at different steps: {insured}"
    steps = stops_by_rank(child.output, pids)
    assert steps["0"] == steps["1"], f"ranks stopped at different steps: {steps}"
    assert steps["0"] >= insured[pids["0"]][0]
    assert (d / "resume.ckpt").exists()


@pytest.mark.timeout(300)
def test_a_fit_stopped_on_one_machine_resumes_from_the_bucket_on_a_new_one(
    references: Reference, s3_bucket: Bucket, tmp_path: Path, spawn
) -> None:
    """save_dir is a bucket's URL. SIGTERM: resume.ckpt is committed in staging and uploaded
    before the process exits. The machine is then gone (its working directory, HOME with the
    staging directory, TMPDIR); the same command on a new one finds ckpt_path there (the
    README's recipe: it exists exactly because the bucket holds a checkpoint), resumes, and
    ends with the weights of a fit never stopped."""
    references.start("plain")
    url = f"{s3_bucket.url}/fit"
    one, two = Machine(tmp_path / "one"), Machine(tmp_path / "two")
    args = ("--resume-if-saved",)
    first = spawn(
        fit_args(one.cwd, "--step-sleep", "0.05", *args, save_dir=url), cwd=one.cwd, env=one.env
    )
    first.wait_line(batch_line(1, 5), timeout=120)
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 0, first.output
    assert "ckpt_path exists False" in first.lines
    one.gone()
    second = spawn(fit_args(two.cwd, *args, save_dir=url), cwd=two.cwd, env=two.env)
    assert second.wait(180) == 0, second.output
    assert "ckpt_path exists True" in second.lines
    assert second.lines.count("batch 1 5") == 0, "a trained batch was replayed"
    assert "batch 2 11" in second.lines
    assert same_weights(references.weights("plain"), two.cwd / "o.pt")
