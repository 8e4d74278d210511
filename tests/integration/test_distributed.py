"""torch.distributed in real processes (gloo, CPU): every rank stops at the same step with the
same exit code, the checkpoints resume every rank exactly, and launchers (torchrun, preemptible
run) see a preempted job.

Ranks are started one by one (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each in its own
process group, so that a test can signal one rank; or by torchrun. A rank that stops alone
leaves the others blocked in their next collective, which the per-test timeout turns into a
failure; the ``spawn`` fixture kills every rank at the end.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from preemptible.checkpoint._payload import read_payload
from preemptible.checkpoint._store import CheckpointStore
from tests.conftest import PY, SCRIPTS, Child, attempts, read_pid, supervise, wait_for
from tests.support.checkpoints import committed
from tests.support.reference import DIR, References, free_port
from tests.support.slurm import job_field

SCRIPT = str(SCRIPTS / "ddp_train.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
STEPS = 24
STOPPED = re.compile(
    r"^rank (\d+): preemptible: (?:rank \d+: )?stopped at step (\d+) on (\S+);"
    r".* exiting with (\d+)$"
)
SAVED = re.compile(r"^rank (\d+): preemptible: (?:rank \d+: )?saved \S+ \(step (\d+),")
# Ranks that share one stream (under torchrun, srun) can write into each other's lines: a
# print is two writes (text, newline), so another rank's line may land between them. Search
# the whole output for these, unanchored.
STOPPED_IN = re.compile(
    r"rank (\d+): preemptible: (?:rank \d+: )?stopped at step (\d+) on (\S+);"
    r"[^\n]* exiting with (\d+)"
)
STEP_IN = re.compile(r"rank 0 step (\d+)")


def reached(step: int) -> Callable[[str], bool]:
    """A line of a shared stream showing that rank 0 started ``step`` or a later one."""
    return lambda line: any(int(m.group(1)) >= step for m in STEP_IN.finditer(line))


def job_args(tmp_path: Path, out: str, *extra: str) -> list[str]:
    return [
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--out",
        str(tmp_path / out),
        "--steps",
        str(STEPS),
        *extra,
    ]


def launch(
    start: Callable[..., Child], world: int, args: list[str], env: dict[str, str] | None = None
) -> list[Child]:
    port = str(free_port())
    return [
        start(
            [PY, SCRIPT, *args],
            env={
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": "1",
                **(env or {}),
            },
        )
        for r in range(world)
    ]


def wait_all(ranks: list[Child], timeout: float) -> list[int]:
    return [r.wait(timeout) for r in ranks]


def stops(ranks: list[Child]) -> list[tuple[int, str, int]]:
    """(step, source, exit code) as each rank logged its stop."""
    found = []
    for child in ranks:
        matches = [m for line in child.lines if (m := STOPPED.match(line))]
        assert len(matches) == 1, child.output
        m = matches[0]
        found.append((int(m.group(2)), m.group(3), int(m.group(4))))
    return found


def saves(child: Child) -> list[int]:
    return [int(m.group(2)) for line in child.lines if (m := SAVED.match(line))]


def outputs(tmp_path: Path, out: str, world: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    weights = torch.load(tmp_path / out, weights_only=True)
    draws = [(tmp_path / f"{out}.rank{r}.json").read_text() for r in range(world)]
    return weights, draws


def assert_same_run(tmp_path: Path, reference: Path, out: str, world: int = 2) -> None:
    got_w, got_draws = outputs(tmp_path, out, world)
    ref_w, ref_draws = outputs(reference, "ref.pt", world)
    assert got_w.keys() == ref_w.keys()
    for k in ref_w:
        assert torch.equal(got_w[k], ref_w[k]), f"{k} differs from the uninterrupted run"
    assert got_draws == ref_draws, "a rank's random streams differ from the uninterrupted run"
    assert len(set(ref_draws)) == world  # each rank really has streams of its own


def resume_exactly(
    tmp_path: Path,
    spawn: Callable[..., Child],
    args: list[str],
    step: int,
    reference: Callable[[], Path],
) -> None:
    """Run the job again on both ranks: it resumes from ``step`` and ends as the reference."""
    again = launch(spawn, 2, args)
    assert wait_all(again, 120) == [0, 0], "\n".join(r.output for r in again)
    assert all(f"resumed {step}" in r.output for r in again)
    assert_same_run(tmp_path, reference(), "out.pt")


REFERENCE = [PY, SCRIPT, *job_args(Path(DIR), "ref.pt", "--save-every", "5")]


@pytest.fixture
def reference(reference_runs: References) -> Callable[[], Path]:
    """An uninterrupted 2-rank run (saving every 5 steps, as the runs compared with it), one
    per session: started as the test begins, beside its own ranks; called, it waits for it and
    gives its directory."""
    reference_runs.start(REFERENCE, ranks=2)
    return lambda: reference_runs.result(REFERENCE, ranks=2, timeout=120)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("sig", "loop"),
    [(signal.SIGINT, "steps"), (signal.SIGTERM, "run"), (signal.SIGUSR1, "own")],
)
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(
    tmp_path: Path, spawn, sig: signal.Signals, loop: str
) -> None:
    """Through each way of looping: steps() (with periodic saves in the background, which
    rank 0 writes), run(), and should_stop/stop() in a loop of one's own."""
    # steps enough that no loaded machine ends the run before the signal lands
    args = job_args(tmp_path, "out.pt", "--step-sleep", "0.02", "--loop", loop)
    args += ["--steps", "100000"]
    if loop == "steps":
        args += ["--save-every", "2", "--async-save"]
    ranks = launch(spawn, 2, args)
    ranks[1].wait_line(lambda line: line == "rank 1 step 5", timeout=90)
    ranks[1].signal(sig)
    assert wait_all(ranks, 60) == [128 + sig] * 2, "\n".join(r.output for r in ranks)
    [(step, source, _), other] = stops(ranks)
    assert other == (step, sig.name, 128 + sig) and source == sig.name
    assert committed(tmp_path / "ckpt")[-1] == f"step-{step:010d}.ckpt"
    if loop == "steps":  # the final checkpoint holds both ranks' streams
        found = CheckpointStore(tmp_path / "ckpt").load_newest(
            lambda p: read_payload(p, weights_only=True)
        )
        assert found is not None and found[0].step == step
        assert len(found[1]["rng_ranks"]) == 2


@pytest.mark.timeout(150)
def test_four_ranks_at_different_speeds_stop_together(tmp_path: Path, spawn) -> None:
    """Rank 3 is slow; rank 0 is signalled: the fast ranks wait in their collectives, the
    agreement waits for nobody, and all four stop at one step. Saves every 0.3 s (rank 0's
    clock) happen at the same steps on every rank too."""
    args = job_args(
        tmp_path,
        "out.pt",
        "--steps",
        "100000",
        "--slow-rank",
        "3",
        "--slow-sleep",
        "0.05",
        "--save-every-seconds",
        "0.3",
    )
    ranks = launch(spawn, 4, args)
    ranks[0].wait_line(lambda line: line == "rank 0 step 30", timeout=120)
    ranks[0].signal(signal.SIGTERM)
    assert wait_all(ranks, 60) == [143] * 4, "\n".join(r.output for r in ranks)
    assert len(set(stops(ranks))) == 1, stops(ranks)
    periodic = [saves(r) for r in ranks]
    assert len(periodic[0]) >= 3 and all(p == periodic[0] for p in periodic), periodic


@pytest.mark.timeout(120)
def test_a_notice_with_a_grace_window_to_one_rank_saves_and_stops_everywhere_alike(
    tmp_path: Path, spawn
) -> None:
    notice = tmp_path / "notice"
    args = job_args(
        tmp_path,
        "out.pt",
        "--steps",
        "100000",
        "--step-sleep",
        "0.05",
        "--notice-file",
        str(notice),
        "--notice-rank",
        "1",
        "--grace",
        "5",  # the save, the agreement and the exit need ~2 s of it on a loaded machine
    )
    ranks = launch(spawn, 2, args)
    ranks[0].wait_line(lambda line: line == "rank 0 step 5", timeout=90)
    notice.touch()
    assert wait_all(ranks, 60) == [143, 143], "\n".join(r.output for r in ranks)
    [(step, source, _), other] = stops(ranks)
    assert other == (step, "test-notice", 143) and source == "test-notice"
    insurance, final = saves(ranks[0])
    assert saves(ranks[1]) == [insurance, final]
    assert final == step and final - insurance >= 5  # it trained on through the window
    assert committed(tmp_path / "ckpt") == [f"step-{insurance:010d}.ckpt", f"step-{step:010d}.ckpt"]


@pytest.mark.timeout(120)
def test_rank_zero_killed_mid_save_leaves_the_previous_checkpoint_the_newest(
    tmp_path: Path, spawn
) -> None:
    args = job_args(tmp_path, "out.pt", "--save-every", "5", "--slow-write", "2")
    ranks = launch(spawn, 2, args, env={"PREEMPTIBLE_DIST_TIMEOUT": "30"})
    ranks[0].wait_line(lambda line: line == "rank 0 wrote step 10", timeout=90)
    ranks[0].signal(signal.SIGKILL)
    assert ranks[0].wait(30) == -signal.SIGKILL
    ranks[1].kill()
    assert committed(tmp_path / "ckpt") == ["step-0000000005.ckpt"]
    [tmp] = (tmp_path / "ckpt").glob(".tmp-step-0000000010*")  # the save it cut short
    assert tmp.stat().st_size > 0

    # what a resume of any rank finds: the previous checkpoint, with both ranks' streams
    found = CheckpointStore(tmp_path / "ckpt").load_newest(
        lambda p: read_payload(p, weights_only=True)
    )
    assert found is not None
    ckpt, payload = found
    assert ckpt.step == 5 and len(payload["rng_ranks"]) == 2


@pytest.mark.timeout(180)
def test_sharded_checkpoints_hold_every_ranks_shards_and_resume_exactly(
    tmp_path: Path, spawn, reference: Callable[[], Path]
) -> None:
    # 0.05 s steps (the weights do not depend on them): the signal lands before the end
    args = job_args(tmp_path, "out.pt", "--save-every", "5", "--sharded", "--step-sleep", "0.05")
    ranks = launch(spawn, 2, args)
    ranks[0].wait_line(lambda line: line == "rank 0 step 7", timeout=90)
    ranks[0].signal(signal.SIGTERM)
    assert wait_all(ranks, 60) == [143, 143], "\n".join(r.output for r in ranks)
    [(step, _, _), _] = stops(ranks)
    newest = tmp_path / "ckpt" / f"step-{step:010d}.ckpt"
    names = sorted(p.name for p in newest.iterdir())
    assert {".metadata", "preemptible.pt", "rng-0.pt", "rng-1.pt"} <= set(names), names

    resume_exactly(tmp_path, spawn, args, step, reference)


@pytest.mark.timeout(180)
def test_sharded_async_saves_train_on_while_writing_and_a_stop_mid_write_commits_its_step(
    tmp_path: Path, spawn, reference: Callable[[], Path]
) -> None:
    """DCP async_save: the ranks train while step 5 is written (its commit held 2 s); SIGTERM
    to rank 1 then stops both at one step, after the write in flight, with that step
    committed; the resumed run ends with the weights and streams of an uninterrupted one."""
    async_args = ["--sharded", "--async-save", "--save-every", "5"]
    args = job_args(tmp_path, "out.pt", *async_args, "--slow-write", "2", "--step-sleep", "0.02")
    ranks = launch(spawn, 2, args)
    ranks[0].wait_line(lambda line: line == "rank 0 wrote step 5", timeout=90)
    ranks[0].wait_line(lambda line: line == "rank 0 step 8", timeout=30)
    ranks[1].signal(signal.SIGTERM)
    assert wait_all(ranks, 60) == [143, 143], "\n".join(r.output for r in ranks)
    [(step, _, _), other] = stops(ranks)
    assert other[0] == step >= 8
    lines = ranks[0].lines
    started = lines.index("rank 0 step 5")  # the save point of step 5 is just before it
    committed_5 = next(i for i, line in enumerate(lines) if "in the background (step 5)" in line)
    trained = [line for line in lines[started:committed_5] if STEP_IN.fullmatch(line)]
    assert len(trained) >= 3, f"only {trained} ran while step 5 was being written"
    names = committed(tmp_path / "ckpt")
    assert names[-1] == f"step-{step:010d}.ckpt", names
    inside = {p.name for p in (tmp_path / "ckpt" / names[-1]).iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rng-0.pt", "rng-1.pt"} <= inside

    resume_exactly(tmp_path, spawn, job_args(tmp_path, "out.pt", *async_args), step, reference)


@pytest.mark.timeout(120)
def test_periodic_saves_by_rank_zeros_clock_go_to_the_background_on_every_rank(
    tmp_path: Path, spawn, reference: Callable[[], Path]
) -> None:
    """save_every_seconds: rank 0's clock asks, all ranks save at the agreed step, and every
    rank knows the save is the periodic one (written in the background), not an insurance."""
    args = job_args(tmp_path, "out.pt", "--sharded", "--async-save", "--save-every-seconds", "0.3")
    ranks = launch(spawn, 2, [*args, "--step-sleep", "0.05"])
    assert wait_all(ranks, 90) == [0, 0], "\n".join(r.output for r in ranks)
    found = [re.findall(r"in the background \(step (\d+)\)", r.output) for r in ranks]
    assert found[0] and found[0] == found[1], found
    assert_same_run(tmp_path, reference(), "out.pt")


@pytest.mark.timeout(180)
def test_rank_zero_killed_mid_sharded_async_save_leaves_the_previous_one_and_resumes_exactly(
    tmp_path: Path, spawn, reference: Callable[[], Path]
) -> None:
    async_args = ["--sharded", "--async-save", "--save-every", "5"]
    args = job_args(tmp_path, "out.pt", *async_args, "--slow-write", "2")
    ranks = launch(spawn, 2, args, env={"PREEMPTIBLE_DIST_TIMEOUT": "30"})
    ranks[0].wait_line(lambda line: line == "rank 0 wrote step 10", timeout=90)
    ranks[0].signal(signal.SIGKILL)  # every rank's shards of step 10 are written, not committed
    assert ranks[0].wait(30) == -signal.SIGKILL
    ranks[1].kill()
    assert committed(tmp_path / "ckpt") == ["step-0000000005.ckpt"]
    [tmp] = (tmp_path / "ckpt").glob(".tmp-step-0000000010*")
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in tmp.iterdir()}

    resume_exactly(tmp_path, spawn, job_args(tmp_path, "out.pt", *async_args), 5, reference)
    assert not list((tmp_path / "ckpt").glob(".tmp-*")), "the dead writer's temporary stayed"


@pytest.mark.timeout(180)
def test_fsdp2_shards_are_written_by_each_rank_and_resumed(tmp_path: Path, spawn) -> None:
    args = job_args(tmp_path, "out.pt", "--fsdp", "--step-sleep", "0.02")
    ranks = launch(spawn, 2, args)
    ranks[1].wait_line(lambda line: line == "rank 1 step 5", timeout=90)
    ranks[1].signal(signal.SIGUSR1)
    assert wait_all(ranks, 60) == [138, 138], "\n".join(r.output for r in ranks)
    [(step, _, _), _] = stops(ranks)
    newest = tmp_path / "ckpt" / f"step-{step:010d}.ckpt"
    shards = sorted(p.name for p in newest.glob("*.distcp"))
    assert len(shards) == 2, shards  # one file of shards per rank

    again = launch(spawn, 2, args)
    assert wait_all(again, 120) == [0, 0], "\n".join(r.output for r in again)
    assert all(f"resumed {step}" in r.output for r in again)


@pytest.mark.timeout(240)
def test_preemptible_run_over_torchrun_classifies_preempted_and_resumes_exactly(
    tmp_path: Path, spawn, reference: Callable[[], Path]
) -> None:
    """SIGTERM to torchrun: it passes it to both ranks at once, which stop together (143), and
    torchrun exits 1; the supervisor reads rank 0's record (PREEMPTED), restarts, and the
    resumed job ends with the weights and the per-rank random streams of the uninterrupted
    run."""
    pid_file = tmp_path / "torchrun.pid"
    job = [
        TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        SCRIPT,
        *job_args(tmp_path, "out.pt", "--save-every", "5"),
    ]
    job += ["--step-sleep", "0.1"]  # time to signal it: pauses change nothing computed
    sup = supervise(spawn, tmp_path, "--pid-file", str(pid_file), "--", *job)
    sup.wait_line(reached(8), timeout=120)
    torchrun = read_pid(pid_file)
    os.kill(torchrun, signal.SIGTERM)
    assert sup.wait(180) == 0, sup.output
    first, second = attempts(tmp_path)
    assert first["state"] == "PREEMPTED", first
    assert second["state"] == "FINISHED", second
    stopped = list(STOPPED_IN.finditer(sup.output))
    assert len(stopped) == 2 and len({(m.group(2), m.group(4)) for m in stopped}) == 1, stopped
    assert stopped[0].group(4) == "143"
    assert_same_run(tmp_path, reference(), "out.pt")


@pytest.mark.timeout(300)
def test_srun_ranks_stopped_by_slurm_are_requeued_and_resume_exactly(
    tmp_path: Path,
    sbatch,
    reference: Callable[[], Path],
) -> None:
    """A real SLURM job: ``preemptible run -- srun`` with two tasks as two ranks. SLURM's own
    SIGTERM to every process of the step (``scancel --signal=TERM``, what a time limit or a
    preemption sends) stops both ranks at one step; the supervisor reads rank 0's record
    (PREEMPTED), requeues the job, and the requeued job resumes and ends with the weights and
    per-rank streams of an uninterrupted run."""
    port = free_port()
    rank_env = (
        "RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS "
        f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} OMP_NUM_THREADS=1"
    )
    train = " ".join(
        [PY, SCRIPT, *job_args(tmp_path, "out.pt", "--save-every", "5", "--step-sleep", "0.1")]
    )
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"cd {tmp_path}\n"
        f"exec {PY} -m preemptible run --checkpoint-dir ckpt -- "
        f"srun --kill-on-bad-exit=0 bash -c '{rank_env} exec {train}'\n"
    )
    out = tmp_path / "job.out"
    job = sbatch("--ntasks=2", "--requeue", "--open-mode=append", "-o", str(out), str(script))
    wait_for(lambda: out.exists() and "rank 0 step 8" in out.read_text(), 120, "step 8")
    subprocess.run(["scancel", "--signal=TERM", job], check=True, timeout=30)
    wait_for(lambda: job_field(job, "JobState") == "COMPLETED", 240, "the job to complete")
    text = out.read_text()
    stopped = list(STOPPED_IN.finditer(text))
    assert len(stopped) == 2 and len({(m.group(2), m.group(4)) for m in stopped}) == 1, text
    assert stopped[0].group(4) == "143", text
    assert f"requeued SLURM job {job}" in text and "FINISHED (exit 0)" in text, text
    assert_same_run(tmp_path, reference(), "out.pt")
