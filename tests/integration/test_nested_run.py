"""Variables set for other purposes are not options: ``PREEMPTIBLE_NOW=1`` does not make a
cancel SIGKILL, and a ``preemptible run`` inside another run's attempt (under an agent or
another supervisor, with ``PREEMPTIBLE_RUN_ID`` set) starts a run of its own instead of
refusing to start. Real CLI processes, a real SQLite queue, states read back."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from preemptible.sweeps.store._queue import open_store
from tests.conftest import PY, Child, python_args, supervise

pytestmark = pytest.mark.timeout(120)

CLI = [PY, "-m", "preemptible"]
# prints the run it is an attempt of and exits 0; one write(2), as the agent's log shares the
# pipe and print() under PYTHONUNBUFFERED writes word by word (a log line landed in between)
SHOW = "import os; os.write(1, ('inner ' + os.environ['PREEMPTIBLE_RUN_ID'] + '\\n').encode())"


def journal(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]


def run_dirs(tmp_path: Path) -> dict[str, Path]:
    return {p.name: p for p in (tmp_path / ".preemptible" / "runs").iterdir()}


def test_preemptible_now_in_the_environment_does_not_make_a_cancel_kill(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    db = f"sqlite://{tmp_path}/q.db"
    spec = tmp_path / "s.yaml"
    spec.write_text(
        json.dumps({"program": "x.py", "method": "grid", "parameters": {"a": {"value": 1}}})
    )
    created = spawn([*CLI, "sweep", "create", str(spec), "--db", db], cwd=tmp_path)
    assert created.wait(60) == 0, created.output
    sweep = created.lines[-1].strip()
    env = {"PREEMPTIBLE_NOW": "1", "PREEMPTIBLE_SWEEP_CANCEL_NOW": "1"}
    cancel = spawn([*CLI, "sweep", "cancel", sweep, "--db", db], cwd=tmp_path, env=env)
    assert cancel.wait(60) == 0, cancel.output
    assert cancel.lines[-1] == f"sweep {sweep}: cancelled", cancel.output
    with open_store(db) as store:
        row = store.sweep(sweep)
    assert (row.control, row.cancel_now) == ("cancelled", False)  # agents send SIGTERM


def test_a_nested_preemptible_run_starts_a_run_of_its_own(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    inner = " ".join([PY, "-m", "preemptible", "run", "--", PY, "-c", f'"{SHOW}"'])
    outer = supervise(spawn, tmp_path, "--", "bash", "-c", inner)
    assert outer.wait(60) == 0, outer.output
    dirs = run_dirs(tmp_path)
    assert len(dirs) == 2, dirs
    [outer_id] = [name for name in dirs if name.startswith("bash-")]
    [inner_id] = [name for name in dirs if name != outer_id]
    assert f"inner {inner_id}" in outer.lines
    assert f"inside an attempt of run '{outer_id}'" in outer.output
    assert [a["state"] for a in journal(dirs[inner_id])] == ["FINISHED"]
    assert [a["state"] for a in journal(dirs[outer_id])] == ["FINISHED"]
    assert "already supervised" not in outer.output


def test_a_nested_run_is_preempted_and_resumed_at_both_levels(
    tmp_path: Path, spawn: Callable[..., Child]
) -> None:
    """SIGTERM to the outer supervisor reaches the trainer through the inner one; the inner
    run is PREEMPTED and tells its parent, which is PREEMPTED too (not CRASHED from a bare
    143); the same command again resumes the same inner run from its checkpoint."""
    train = python_args("light_train.py", "--ckpt", "ck", "--steps", "100000")
    args = ["--", *CLI, "run", "--", *train]
    outer = supervise(spawn, tmp_path, *args)
    outer.wait_line(lambda line: line == "step 3", 60)
    outer.signal(signal.SIGTERM)
    assert outer.wait(60) == 143, outer.output
    dirs = run_dirs(tmp_path)
    [outer_id] = [name for name in dirs if name.startswith("preemptible-")]
    [inner_id] = [name for name in dirs if name != outer_id]
    [inner_first] = journal(dirs[inner_id])
    [outer_first] = journal(dirs[outer_id])
    assert inner_first["state"] == "PREEMPTED" and outer_first["state"] == "PREEMPTED"
    record = json.loads((dirs[outer_id] / "attempt-1" / "record.json").read_text())
    assert record["nested_run"] == inner_id and record["state"] == "stopped"
    saved = int(record["step"])

    again = supervise(spawn, tmp_path, *args)
    again.wait_line(lambda line: re.fullmatch(r"resumed \d+", line) is not None, 60)
    assert f"resumed {saved}" in again.lines, again.output
    again.signal(signal.SIGTERM)
    assert again.wait(60) == 143, again.output
    assert set(run_dirs(tmp_path)) == {outer_id, inner_id}  # the same two runs


def test_a_parent_run_id_is_never_a_path(tmp_path: Path, spawn: Callable[..., Child]) -> None:
    """PREEMPTIBLE_RUN_ID is the parent's, not this run's: a hostile one names no directory,
    and a directory that no supervisor made for this process is not written in."""
    parent = tmp_path / "parent" / "attempt-1"
    parent.mkdir(parents=True)
    env = {"PREEMPTIBLE_RUN_ID": "../../x", "PREEMPTIBLE_RUN_DIR": str(parent)}
    sup = supervise(spawn, tmp_path, "--", PY, "-c", "pass", env=env)
    assert sup.wait(30) == 0, sup.output
    [(name, _)] = run_dirs(tmp_path).items()
    assert re.fullmatch(r"python-[0-9a-f]{8}", name), name
    assert sorted(p.name for p in tmp_path.iterdir()) == [".preemptible", "parent"]
    assert list(parent.iterdir()) == []


@pytest.mark.parametrize("other", ["ended", "running"])
def test_a_leftover_attempt_environment_never_writes_into_that_run(
    tmp_path: Path, spawn: Callable[..., Child], other: str
) -> None:
    """A shell that kept an attempt's variables (run A's id, attempt, PREEMPTIBLE_RUN_DIR and
    checkpoint directory) starts ``preemptible run``: a run of its own, said in one line, with
    checkpoints of its own; A's record.json and checkpoints stay byte for byte as they were,
    whether A has ended or still runs (its supervisor alive, but no ancestor of this one).
    It used to count as nested in A and replace A's record with its own."""
    a_home, b_home = tmp_path / "a", tmp_path / "b"
    a_home.mkdir()
    b_home.mkdir()
    steps = "3" if other == "ended" else "100000"
    a = supervise(spawn, a_home, "--", *python_args("light_train.py", "--steps", steps))
    if other == "ended":
        assert a.wait(60) == 0, a.output
    else:
        a.wait_line(lambda line: line == "step 2", 60)
    [(a_id, a_run)] = run_dirs(a_home).items()
    attempt = (a_run / "attempt-1").resolve()
    kept = [attempt / "record.json", *sorted((a_run / "checkpoints").iterdir())]
    before = {p: p.read_bytes() for p in kept}
    assert len(before) >= 2, before
    env = {
        "PREEMPTIBLE_RUN_ID": a_id,
        "PREEMPTIBLE_ATTEMPT": "1",
        "PREEMPTIBLE_RUN_DIR": str(attempt),
        "PREEMPTIBLE_CHECKPOINT_DIR": str((a_run / "checkpoints").resolve()),
    }
    b = supervise(spawn, b_home, "--", *python_args("light_train.py", "--steps", "3"), env=env)
    code = b.wait(60)
    assert {p: p.read_bytes() for p in kept} == before
    assert code == 0, b.output
    assert f"PREEMPTIBLE_RUN_DIR={attempt} is not an attempt this process is part of" in b.output
    [(b_id, b_run)] = run_dirs(b_home).items()
    assert b_id != a_id and [a["state"] for a in journal(b_run)] == ["FINISHED"]
    record = json.loads((b_run / "attempt-1" / "record.json").read_text())
    assert "resumed 0" in b.lines  # not from A's checkpoints: B has its own
    assert record["checkpoint_dir"] == str(b_run.resolve() / "checkpoints")
    if other == "running":
        assert a.proc.poll() is None, a.output  # A trained on meanwhile
        a.signal(signal.SIGTERM)
        assert a.wait(60) == 143, a.output


def test_a_nested_run_under_an_agent(tmp_path: Path, spawn: Callable[..., Child]) -> None:
    """A sweep program that itself uses ``preemptible run`` (a job script written for single
    runs): it runs, as a run of its own, and the sweep's run finishes."""
    program = tmp_path / "job.py"
    program.write_text(
        "import subprocess, sys\n"
        f"sys.exit(subprocess.call([sys.executable, '-m', 'preemptible', 'run', '--', "
        f"sys.executable, '-c', {SHOW!r}]))\n"
    )
    db = f"sqlite://{tmp_path}/q.db"
    spec = tmp_path / "s.yaml"
    spec.write_text(
        json.dumps({"program": str(program), "method": "grid", "parameters": {"a": {"value": 1}}})
    )
    created = spawn([*CLI, "sweep", "create", str(spec), "--db", db], cwd=tmp_path)
    assert created.wait(60) == 0, created.output
    sweep = created.lines[-1].strip()
    agent = spawn([*CLI, "agent", sweep, "--db", db, "--heartbeat", "0.5"], cwd=tmp_path)
    assert agent.wait(60) == 0, agent.output
    with open_store(db) as store:
        [run] = store.runs(sweep)
    assert run.state == "FINISHED", agent.output
    assert "already supervised" not in agent.output
    inner = [line for line in agent.lines if line.startswith("inner ")]
    assert inner and inner[0] != f"inner {run.id}", agent.output
