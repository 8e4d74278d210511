"""Reading a run never creates its directories: the supervisor's resume lookup, the agent's
newest step and ``preemptible runs`` leave a missing checkpoint directory missing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from preemptible._paths import RunPaths, read_journal, tail_lines
from preemptible.checkpoint._store import CheckpointStore, checkpoint_name
from preemptible.supervisor import Supervisor, SupervisorConfig
from preemptible.supervisor._runs import list_runs
from preemptible.sweeps.agent._agent import _newest_step


def test_a_store_opened_without_create_leaves_a_missing_directory_missing(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "a" / "ckpt"
    store = CheckpointStore(missing, create=False)
    assert store.latest() is None
    assert store.committed() == []
    assert not (tmp_path / "a").exists()
    missing.mkdir(parents=True)
    (missing / checkpoint_name(7)).write_bytes(b"x")
    latest = CheckpointStore(missing, create=False).latest()
    assert latest is not None and latest.step == 7


def test_the_supervisors_resume_lookup_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREEMPTIBLE_RUN_DIR", raising=False)
    ckpt = tmp_path / "ckpt"
    sup = Supervisor(
        SupervisorConfig(
            command=[sys.executable, "-c", "pass"],
            home=tmp_path / "home",
            run_id="r",
            checkpoint_dir=ckpt,
        )
    )
    env = sup._environment(1, sup.paths.attempt(1))
    assert "PREEMPTIBLE_RESUME_FROM" not in env
    assert sup.resumes.newest_name() == "none"
    assert not ckpt.exists()
    assert not (tmp_path / "home").exists()


def test_the_agents_newest_step_creates_nothing(tmp_path: Path) -> None:
    assert _newest_step(tmp_path / "ckpt") is None
    assert not (tmp_path / "ckpt").exists()


def test_preemptible_runs_creates_no_checkpoint_directory(tmp_path: Path) -> None:
    run = RunPaths.under(tmp_path, "r")
    elsewhere = tmp_path / "elsewhere"
    run.attempt(1).mkdir(parents=True)
    run.record(1).write_text(json.dumps({"state": "stopped", "checkpoint_dir": str(elsewhere)}))
    [row] = list_runs(tmp_path)
    assert row["run_id"] == "r" and row["attempts"] == 1 and row["checkpoint"] is None
    assert not run.checkpoints.exists() and not elsewhere.exists()
    run.checkpoints.mkdir()
    (run.checkpoints / checkpoint_name(3)).write_bytes(b"x")
    [row] = list_runs(tmp_path)
    assert row["checkpoint"] == str(run.checkpoints / checkpoint_name(3))


def test_attempt_numbers_take_plain_decimal_names_only(tmp_path: Path) -> None:
    run = RunPaths(tmp_path)
    for name in ("attempt-1", "attempt-12", "attempt-²", "attempt-x", "attempt-1234567890"):
        (tmp_path / name).mkdir()
    (tmp_path / "attempt-40").write_text("")  # a file, not an attempt's directory
    assert sorted(run.attempt_numbers()) == [1, 12]
    assert sorted(run.attempt_numbers(directories_only=False)) == [1, 12, 40]
    assert run.newest_attempt() == 12
    assert RunPaths(tmp_path / "missing").attempt_numbers() == []


def test_the_journal_reader_keeps_objects_and_marks_odd_lines(tmp_path: Path) -> None:
    journal = RunPaths(tmp_path).journal
    journal.write_text('{"attempt": 1}\n\n[1]\nnot json\n{"attempt": 2}\n')
    assert read_journal(journal, 1 << 16) == [{"attempt": 1}, {}, {}, {"attempt": 2}]
    assert read_journal(tmp_path / "missing", 1 << 16) == []
    assert tail_lines(journal, 16) == ['{"attempt": 2}']  # the first line read was cut


def test_read_bounded_says_what_a_path_is_and_reads_one_byte_past_the_limit(
    tmp_path: Path,
) -> None:
    import os

    from preemptible._errors import NoticeError
    from preemptible._paths import read_bounded, read_regular
    from preemptible.notices._lease import LeaseFile

    big = tmp_path / "big"
    big.write_bytes(b"x" * 100)
    assert read_bounded(big, 10) == b"x" * 11  # the caller can tell it is too large
    assert read_regular(big, 10) == b"x" * 10
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((tmp_path, "a directory"), (fifo, "a FIFO")):
        with pytest.raises(OSError, match=f"is {kind}, not a regular file"):
            read_bounded(path, 10)
        assert read_regular(path, 10) is None
    with pytest.raises(FileNotFoundError):
        read_bounded(tmp_path / "missing", 10)
    # the lease reader: a missing file is no lease, a FIFO a bad one (never a wait)
    assert LeaseFile(tmp_path / "missing").remaining() is None
    with pytest.raises(NoticeError, match="a FIFO"):
        LeaseFile(fifo).remaining()
