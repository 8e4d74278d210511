"""The exit time, measured by the supervisor and budgeted by the next attempt: the record's
``committed_at``, the journal's ``exit_s``, ``PREEMPTIBLE_EXIT_SECONDS`` and the config."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from preemptible import TerminationConfig
from preemptible._errors import ConfigError
from preemptible._paths import JOURNAL_NAME
from preemptible._run import RECORD_NAME, read_record, update_record
from preemptible.stop._termination import exit_process
from preemptible.supervisor import Supervisor, SupervisorConfig
from preemptible.supervisor._journal import exit_seconds, measured_exits


def test_the_record_times_the_final_commit_and_keeps_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREEMPTIBLE_RUN_DIR", str(tmp_path))
    update_record(state="stopping", step=3)
    assert "committed_at" not in read_record(tmp_path)  # the save has not committed yet
    update_record(state="stopped", checkpoint="/c/3")
    first = read_record(tmp_path)["committed_at"]
    update_record(state="stopped", checkpoint="/c/4")
    record = read_record(tmp_path)
    assert record["committed_at"] >= first
    assert record["committed_at"] == record["updated_at"]


def write_record(attempt_dir: Path, **fields: object) -> None:
    attempt_dir.mkdir(parents=True, exist_ok=True)
    (attempt_dir / RECORD_NAME).write_text(json.dumps(fields))


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"state": "stopped", "committed_at": 1000.0}, 0.75),
        ({"state": "stopped", "committed_at": 1000}, 0.75),  # an int is a time too
        ({"state": "stopping", "committed_at": 1000.0}, None),  # the save did not commit
        ({"state": "stopped"}, None),
        ({"state": "stopped", "committed_at": 1001.0}, None),  # after the reap: not believable
        ({"state": "stopped", "committed_at": 900.0}, None),  # before the attempt started
        ({"state": "stopped", "committed_at": "1000"}, None),
        ({"state": "stopped", "committed_at": True}, None),
    ],
)
def test_exit_seconds_from_the_commit_to_the_reap(
    tmp_path: Path, fields: dict[str, object], expected: float | None
) -> None:
    write_record(tmp_path, **fields)
    assert exit_seconds(tmp_path, gone=1000.75, duration=60.0) == expected


def test_exit_seconds_without_a_record(tmp_path: Path) -> None:
    assert exit_seconds(tmp_path, gone=1000.0, duration=60.0) is None


def test_the_last_three_measured_exits_are_read_from_the_journal(tmp_path: Path) -> None:
    journal = tmp_path / JOURNAL_NAME
    assert measured_exits(journal) == []
    lines = [
        {"attempt": 1, "exit_s": 9.0},  # older than the last three
        {"attempt": 2, "exit_s": 0.4},
        {"attempt": 3},  # no final commit (a crash): no measurement
        "not json",
        {"attempt": 4, "exit_s": "0.5"},
        {"attempt": 5, "exit_s": -1.0},
        {"attempt": 6, "exit_s": 1.25},
        [1, 2],
        {"attempt": 7, "exit_s": 0.3},
    ]
    journal.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines))
    assert measured_exits(journal) == [0.4, 1.25, 0.3]


def test_the_next_attempt_gets_the_longest_of_the_last_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREEMPTIBLE_EXIT_SECONDS", raising=False)
    sup = Supervisor(
        SupervisorConfig(command=[sys.executable, "-c", "pass"], home=tmp_path, run_id="r")
    )
    sup.run_dir.mkdir(parents=True)
    assert "PREEMPTIBLE_EXIT_SECONDS" not in sup._environment(1, sup.run_dir / "attempt-1")
    entries = [{"attempt": n, "exit_s": s} for n, s in [(1, 5.0), (2, 0.5), (3, 1.5), (4, 0.25)]]
    (sup.run_dir / JOURNAL_NAME).write_text("".join(json.dumps(e) + "\n" for e in entries))
    env = sup._environment(5, sup.run_dir / "attempt-5")
    assert env["PREEMPTIBLE_EXIT_SECONDS"] == "1.500"
    monkeypatch.setenv("PREEMPTIBLE_EXIT_SECONDS", "7")  # the user's guess: the measurement wins
    assert sup._environment(5, sup.run_dir / "attempt-5")["PREEMPTIBLE_EXIT_SECONDS"] == "1.500"


def test_the_config_budgets_the_measured_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREEMPTIBLE_EXIT_SECONDS", raising=False)
    assert TerminationConfig().exit_time is None  # the policy's default, EXIT_TIME
    monkeypatch.setenv("PREEMPTIBLE_EXIT_SECONDS", "1.5")
    assert TerminationConfig().exit_time == 1.5
    assert TerminationConfig(exit_time=3.0).exit_time == 3.0  # given in code: it wins


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf"])
def test_a_bad_exit_seconds_is_one_clear_line(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("PREEMPTIBLE_EXIT_SECONDS", value)
    with pytest.raises(ConfigError) as info:
        TerminationConfig()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"PREEMPTIBLE_EXIT_SECONDS={value!r} is not valid; use seconds")


def test_the_default_exit_fn_is_a_short_exit() -> None:
    assert TerminationConfig().exit_fn is exit_process

    def mine(code: int) -> None:
        pass

    assert TerminationConfig(exit_fn=mine).exit_fn is mine
