"""Every place a stop can reach a Lightning fit (real fits in subprocesses, real signals).

Each case: the stop is acted on where it arrives (a validation batch, the sanity check, the
last epoch's end, a cloud notice), ``resume.ckpt`` is committed, the exit code and tracker
status are the documented ones, and the resumed fit ends with the same weights, bit for bit,
as a fit never stopped.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import torch

from tests.conftest import Child
from tests.support.checkpoints import fit_args, same_weights, temporaries
from tests.support.metadata import MetadataServer
from tests.support.reference import DIR, References

pytestmark = pytest.mark.timeout(240)

# The fits compared with each reference differ only in what does not change the weights
# (sleeps, a longer validation set, a sanity check, a tracker).
REFERENCES = {"val": ["--val"]}


def after(*lines: str) -> Callable[[str], bool]:
    """Matches the last of ``lines`` once the others have been seen, in order."""
    seen = [0]

    def match(line: str) -> bool:
        if line == lines[seen[0]]:
            seen[0] += 1
        return seen[0] == len(lines)

    return match


def tracker_events(d: Path) -> list[tuple[str, str | None]]:
    events = [json.loads(line) for line in (d / "tracker.jsonl").read_text().splitlines()]
    return [(e["event"], e.get("status")) for e in events]


class Reference:
    """The uninterrupted fit of each kind (one per session, shared with test_lightning.py):
    ``start`` it as a test begins, it runs beside the test's own fits; ``weights`` waits."""

    def __init__(self, runs: References) -> None:
        self.runs = runs

    def start(self, kind: str) -> None:
        self.runs.start(fit_args(Path(DIR), *REFERENCES[kind]))

    def weights(self, kind: str) -> Path:
        return self.runs.result(fit_args(Path(DIR), *REFERENCES[kind])) / "o.pt"


@pytest.fixture
def references(reference_runs: References) -> Reference:
    return Reference(reference_runs)


def val_sleep_from(step: int) -> list[str]:
    """Validations sleep from global step ``step`` on (where the stop lands; 12 batches an
    epoch): as slow there as before, the earlier ones take no time."""
    return ["--val-sleep-from", str(step)]


def resume(spawn, d: Path, *extra: str) -> Child:
    child = spawn(fit_args(d, "--resume", "--val-sleep", "0", *extra))
    assert child.wait(180) == 0, child.output
    assert "fit done received_sigterm=False" in child.lines
    return child


def validated_first(child: Child) -> bool:
    """The validation abandoned at batch 0 3 ran before the next training batch."""
    lines = child.lines
    return "val 0" in lines and lines.index("val 0") < lines.index("batch 0 4")


@pytest.mark.timeout(400)
def test_stops_in_validations_and_a_kill_mid_write(
    references: Reference, tmp_path: Path, spawn
) -> None:
    references.start("val")
    ckpt = tmp_path / "resume.ckpt"
    # 1. SIGTERM in a validation pass mid-epoch: four batches of 1 s each after batch 3, and
    # the stop must not wait for them.
    first = spawn(fit_args(tmp_path, "--val", "--val-size", "32", "--step-sleep", "0.05"))
    first.wait_line(after("batch 0 3", "val 0"), timeout=120)
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 0, first.output
    assert "val 1" not in first.lines, "the validation pass was not abandoned"
    assert "batch 0 4" not in first.lines
    assert temporaries(tmp_path, ".tmp-resume.ckpt.*") == []
    committed = ckpt.read_bytes()

    # 2. Resumed: the abandoned validation runs first, and a stop during it keeps the
    # checkpoint it resumed from (the same state), at once.
    again = spawn(fit_args(tmp_path, "--resume", "--val", "--step-sleep", "0.05"))
    again.wait_line(lambda line: line == "val 0", timeout=120)
    again.signal(signal.SIGTERM)
    assert again.wait(60) == 0, again.output
    assert "val 1" not in again.lines and "batch 0 4" not in again.lines
    assert "this step's checkpoint" in again.output and ckpt.read_bytes() == committed

    # 3. Resumed again: a stop whose write is killed halfway leaves the previous resume.ckpt
    # as it was (the write went to a temporary).
    second = spawn(
        fit_args(
            tmp_path,
            *("--resume", "--val", "--val-sleep", "0", "--slow-write", "60"),
            *("--step-sleep", "0.05"),  # the fit must not end before the signal lands
        )
    )
    second.wait_line(lambda line: line == "batch 1 2", timeout=120)
    assert validated_first(second), second.output
    second.signal(signal.SIGTERM)
    second.wait_line(lambda line: line.startswith("writing "), timeout=30)
    second.kill()  # SIGKILL to the group
    assert ckpt.read_bytes() == committed, "resume.ckpt was written in place"
    [torn] = temporaries(tmp_path, ".tmp-resume.ckpt.*")

    # 4. Resumed again from the same checkpoint: SIGINT in the final validation, after the
    # last training batch, still saves and exits; the tracker says "killed".
    third = spawn(
        fit_args(
            tmp_path,
            *("--resume", "--val", "--val-sleep", "1.0"),  # 1 s to land the SIGINT in
            *val_sleep_from(36),  # the final validation only
            *("--tracker", "local", "--exit-code", "signal"),
        )
    )
    third.wait_line(after("batch 2 11", "val 0"), timeout=120)
    third.signal(signal.SIGINT)
    assert third.wait(60) == 130, third.output
    assert not torn.exists(), "the killed writer's temporary was not cleaned up"
    assert validated_first(third), third.output
    assert "val 1" not in third.lines[third.lines.index("batch 2 11") :]
    assert "later train-end hook ran" not in third.output
    assert tracker_events(tmp_path) == [("checkpoint", None), ("finalize", "killed")]

    # 5. The final validation runs on resume, no training is left, the weights are exact.
    fourth = resume(spawn, tmp_path, "--val")
    assert "val 0" in fourth.lines
    assert not any(line.startswith("batch ") for line in fourth.lines)
    assert same_weights(references.weights("val"), tmp_path / "o.pt")


@pytest.mark.timeout(300)
def test_sigterm_in_the_sanity_check_then_in_the_last_epoch_end(
    references: Reference, tmp_path: Path, spawn
) -> None:
    references.start("val")
    args = ["--val", "--sanity-steps", "2"]
    # 1. The sanity check: the SIGTERM is ours, not Lightning's (no SIGTERMException).
    first = spawn(fit_args(tmp_path, *args, "--step-sleep", "0.05", "--tracker", "local"))
    first.wait_line(lambda line: line == "sanity val 0", timeout=120)
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 0, first.output
    out = first.output
    assert "Received SIGTERM" not in out and "SIGTERMException" not in out
    assert "sanity val 1" not in first.lines and "batch 0 0" not in first.lines
    assert (tmp_path / "resume.ckpt").exists()
    assert tracker_events(tmp_path) == [("checkpoint", None), ("finalize", "preempted")]

    # 2. Resumed: the sanity check runs again first. A SIGTERM in the last epoch's
    # on_train_epoch_end, after all training, still saves and exits with its code; one more
    # SIGTERM while the script unwinds (its finally block) exits at once with that same code
    # instead of killing the process.
    run_dir = tmp_path / "run"
    second = spawn(
        fit_args(
            tmp_path,
            *("--resume", *args, "--epoch-end-sleep", "1", "--exit-code", "signal"),
            *("--slow-finally", "60"),
        ),
        env={"PREEMPTIBLE_RUN_DIR": str(run_dir)},
    )
    second.wait_line(lambda line: line == "epoch end 2", timeout=120)  # the last epoch
    assert second.lines.index("sanity val 0") < second.lines.index("batch 0 0")
    second.signal(signal.SIGTERM)
    second.wait_line(lambda line: line == "finally", timeout=60)
    second.signal(signal.SIGTERM)
    assert second.wait(10) == 143, second.output
    assert "exiting now with 143" in second.output
    assert not any(line.startswith("fit done") for line in second.lines), "the script went on"
    assert "later train-end hook ran" not in second.output
    record = json.loads((run_dir / "record.json").read_text())
    assert record["state"] == "stopped" and record["signum"] == signal.SIGTERM
    assert record["checkpoint"] == str((tmp_path / "resume.ckpt").resolve())

    # 3. Nothing is left to train; the weights are exact.
    third = resume(spawn, tmp_path, *args)
    assert not any(line.startswith("batch ") for line in third.lines)
    assert same_weights(references.weights("val"), tmp_path / "o.pt")


# ModelCheckpoint(monitor="val_loss") in the fit: validation at each epoch's end (it then saves
# in on_train_epoch_end; a ReduceLROnPlateau on val_loss steps at each epoch's end too) or every
# 4 of the 12 batches (it saves in on_validation_end).
MC_KINDS = {
    "epoch-end": [
        *("--val", "--val-every", "epoch", "--val-size", "32", "--model-checkpoint", "2"),
        "--plateau",
    ],
    "every-4": ["--val", "--val-size", "32", "--model-checkpoint", "-1"],
}


@pytest.fixture
def mc_reference(reference_runs: References) -> Callable[[str], Path]:
    """The uninterrupted fit of a kind (one per session): its directory, once it ended."""
    return lambda kind: reference_runs.result(fit_args(Path(DIR), *MC_KINDS[kind]))


def mc_state(d: Path) -> dict[str, object]:
    """What fit.py's ModelCheckpoint holds at the end: the file names in its directory,
    best_model_path and best_k_models (file name -> score)."""
    return cast(dict[str, object], json.loads((d / "mc.json").read_text()))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("kind", "stop_after"),
    [
        ("epoch-end", ("batch 1 11",)),
        ("epoch-end", ("batch 1 11", "val 0")),
        ("every-4", ("batch 1 11",)),
    ],
    ids=["last-batch", "in-the-epoch-end-validation", "last-batch-validation-every-4"],
)
def test_model_checkpoint_after_a_stop_at_an_epochs_end_is_the_uninterrupted_fits(
    kind: str,
    stop_after: tuple[str, ...],
    mc_reference: Callable[[str], Path],
    reference_runs: References,
    tmp_path: Path,
    spawn,
) -> None:
    """A stop on the last batch of epoch 1, or in the validation after it: the resumed fit runs
    that validation and the epoch's end as the uninterrupted fit did, so ModelCheckpoint writes
    the same files (epoch=1-step=24.ckpt, with the same loop state inside) and ends with the
    same best_model_path and best_k_models, the module's on_train_epoch_end runs for epoch 1,
    and the plateau scheduler steps there (exact weights). (None of it used to run: Lightning's
    restore counts that epoch as ended.)"""
    reference_runs.start(fit_args(Path(DIR), *MC_KINDS[kind]))
    first = spawn(fit_args(tmp_path, *MC_KINDS[kind], "--step-sleep", "0.05", *val_sleep_from(24)))
    first.wait_line(after(*stop_after), timeout=120)
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 0, first.output
    assert "epoch end 1" not in first.lines and "batch 2 0" not in first.lines
    assert "val 1" not in first.lines[first.lines.index("batch 1 11") :]
    second = resume(spawn, tmp_path, *MC_KINDS[kind])
    ref = mc_reference(kind)
    assert mc_state(tmp_path) == mc_state(ref)
    lines = second.lines
    assert "epoch end 1" in lines, second.output
    assert lines.index("val 0") < lines.index("epoch end 1") < lines.index("batch 2 0")
    replayed = "epoch=1-step=24.ckpt"
    mine, theirs = (torch.load(d / "mc" / replayed, weights_only=False) for d in (tmp_path, ref))
    assert (mine["epoch"], mine["global_step"]) == (1, 24)
    assert (theirs["epoch"], theirs["global_step"]) == (1, 24)
    assert mine["loops"] == theirs["loops"]
    assert same_weights(ref / "o.pt", tmp_path / "o.pt")


WINDOW = 6.0  # seconds of notice the fake GCE gives


def test_gce_notice_insurance_then_final_before_the_deadline(
    references: Reference, tmp_path: Path, spawn
) -> None:
    references.weights("val")  # not beside the timed window: it runs first if it must
    with MetadataServer() as server:
        env = {
            "GCE_METADATA_HOST": server.host,
            "PREEMPTIBLE_GCE_NOTICE_SECONDS": str(WINDOW),
            "PREEMPTIBLE_POLL_INTERVAL": "0.2",
        }
        first = spawn(
            fit_args(
                tmp_path,
                *("--val", "--step-sleep", "0.1", "--val-sleep", "0.2", "--exit-code", "signal"),
            ),
            env=env,
        )
        first.wait_line(lambda line: line == "batch 0 5", timeout=120)
        noticed = time.time()
        server.state.gce_preempted = "TRUE"
        final = first.wait_line(lambda line: "then stopping" in line, timeout=30)
        assert first.wait(60) == 143, first.output
        exited = time.time()
    out = first.lines
    insurance = next(i for i, line in enumerate(out) if "insurance checkpoint" in line)
    trained_on = [line for line in out[insurance : out.index(final)] if line.startswith("batch ")]
    assert len(trained_on) >= 5, f"training should go on after the insurance save\n{first.output}"
    committed = (tmp_path / "resume.ckpt").stat().st_mtime - noticed
    assert 0.4 * WINDOW < committed < WINDOW, f"final checkpoint {committed:.2f} s after notice"
    # The process exit after the commit is interpreter shutdown (torch + Lightning): not
    # counted by the grace policy; bounded here so that a hang would show.
    assert exited - noticed < WINDOW + 15, f"exited {exited - noticed:.2f} s after the notice"
    assert temporaries(tmp_path, ".tmp-resume.ckpt.*") == []
    resume(spawn, tmp_path, "--val")
    assert same_weights(references.weights("val"), tmp_path / "o.pt")


def test_ddp_stop_after_the_last_batch_on_one_rank_stops_both_alike(tmp_path: Path, spawn) -> None:
    child = spawn(
        fit_args(
            tmp_path,
            *("--devices", "2", "--epochs", "1", "--epoch-end-sleep", "2"),
            *("--exit-code", "signal"),
        ),
        env={"MASTER_PORT": "29417"},
    )
    pids: dict[str, int] = {}
    while len(pids) < 2:
        line = child.wait_line(
            lambda line: line.startswith("rank ") and line.split()[1] not in pids, timeout=120
        )
        pids[line.split()[1]] = int(line.split()[3])
    # both ranks print to one pipe, so lines can run together: match a substring
    child.wait_line(lambda line: "epoch end 0" in line, timeout=120)
    os.kill(pids["1"], signal.SIGINT)  # rank 1 only, after all training
    assert child.wait(120) == 130, child.output  # rank 0 exits as rank 1 was told to
    stops = re.findall(r"stopped at step \d+ on \S+; .*; exiting with 130", child.output)
    assert len(stops) == 2, child.output
    assert "fit done" not in child.output
    assert (tmp_path / "resume.ckpt").exists() and temporaries(tmp_path, ".tmp-resume.ckpt.*") == []


def test_a_stop_in_the_final_validation_is_resumed_once_and_a_rerun_does_nothing(
    references: Reference, tmp_path: Path, spawn
) -> None:
    """The resumed fit runs the final validation that was due (and nothing else); its end is
    committed, so the same command run once more validates nothing again."""
    references.start("val")
    first = spawn(
        fit_args(
            tmp_path, "--val", "--step-sleep", "0.05", *val_sleep_from(36), "--exit-code", "signal"
        )
    )
    first.wait_line(after("batch 2 11", "val 0"), timeout=180)
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 143, first.output
    second = resume(spawn, tmp_path, "--val")
    assert not any(line.startswith("batch ") for line in second.lines)
    assert any(line.startswith("val ") for line in second.lines), "the due validation"
    assert same_weights(references.weights("val"), tmp_path / "o.pt")
    third = resume(spawn, tmp_path, "--val")
    assert not any(line.startswith(("batch ", "val ")) for line in third.lines), third.output
    assert "resume.ckpt is of a finished run; nothing left to train" in third.output


def test_a_signal_after_training_ended_is_passed_on_not_swallowed(tmp_path: Path, spawn) -> None:
    """A SIGTERM while a later callback still runs its train-end hook: no boundary is left to
    act on it. It reaches the process once the callback's handlers are gone (it dies by it, as
    without the callback) instead of being swallowed while the script goes on."""
    child = spawn(
        fit_args(tmp_path, "--epochs", "1", "--train-end-sleep", "5", "--exit-code", "signal")
    )
    child.wait_line(lambda line: line == "later train-end hook ran", timeout=120)
    child.signal(signal.SIGTERM)
    assert child.wait(60) == -signal.SIGTERM, child.output
    assert "SIGTERM arrived after training finished; passing it on" in child.output
    assert not any(line.startswith("fit done") for line in child.lines)
