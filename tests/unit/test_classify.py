"""The state table, cell by cell, and the exit code that goes with each state."""

from __future__ import annotations

import signal

import pytest

from preemptible.supervisor import Ending, RunState, classify, exit_code_for
from preemptible.supervisor._slurm import parse_time_left

F, X, P, K, C = (
    RunState.FINISHED,
    RunState.FAILED,
    RunState.PREEMPTED,
    RunState.KILLED,
    RunState.CRASHED,
)
ENDINGS = {
    "exit 0": Ending(exit_code=0),
    "exit non-zero": Ending(exit_code=3),
    "SIGKILL": Ending(signal=signal.SIGKILL),
    "lost": Ending(lost=True),
    "SIGINT": Ending(signal=signal.SIGINT),
    "SIGTERM": Ending(signal=signal.SIGTERM),
    "SIGUSR1": Ending(signal=signal.SIGUSR1),
}
RECORDS = {
    "none": {},
    "stopping": {
        "state": "stopped",
        "preempting": True,
        "preempting_at": 10.0,
        "stopped_at": 10.0,
        "signum": 15,
    },
    "start": {"preempting": True, "preempting_at": 1.0},
}
TABLE = {  # DESIGN.md's table: ending -> (no mark, marked while stopping, marked at start)
    "exit 0": (F, P, F),
    "exit non-zero": (X, P, P),
    "SIGKILL": (C, C, P),
    "lost": (C, C, P),
    "SIGINT": (K, P, P),
    "SIGTERM": (C, P, P),
    "SIGUSR1": (C, P, P),
}


@pytest.mark.parametrize("ending", list(TABLE))
@pytest.mark.parametrize("column", [0, 1, 2], ids=["no-mark", "marked-stopping", "marked-start"])
def test_state_table(ending: str, column: int) -> None:
    record = RECORDS[list(RECORDS)[column]]
    assert classify(ENDINGS[ending], record) is TABLE[ending][column]


@pytest.mark.parametrize("forwarded", [None, signal.SIGTERM, signal.SIGINT])
def test_a_stop_whose_save_raised_is_failed(forwarded: int | None) -> None:
    """The stop raised instead of committing (a bad state value, a full disk): FAILED, with
    the job's own exit code, as its tracker says; a second signal or a kill is not that."""
    record = {**RECORDS["stopping"], "state": "save_failed"}
    ending = Ending(exit_code=1)
    assert classify(ending, record, first_signal_at=9.0, forwarded=forwarded) is X
    assert exit_code_for(X, ending, record, forwarded) == 1
    marked_at_start = {**record, "preempting_at": 1.0}
    assert classify(ending, marked_at_start, forwarded=forwarded) is X
    # killed while it failed: the ending decides, as in the table
    assert classify(Ending(signal=signal.SIGKILL), record, first_signal_at=9.0) is C
    # cut short by a second signal, the record still says "stopping": PREEMPTED
    assert classify(ending, {**record, "state": "stopping"}, forwarded=forwarded) is P


def test_mark_after_the_supervisors_signal_is_not_a_mark_at_start() -> None:
    record = {"preempting": True, "preempting_at": 20.0}  # a user's SIGTERM handler marked it
    assert classify(Ending(signal=signal.SIGKILL), record, first_signal_at=19.0) is C
    assert classify(Ending(signal=signal.SIGKILL), record, first_signal_at=21.0) is P


@pytest.mark.parametrize(
    ("forwarded", "state", "code"),
    [(signal.SIGTERM, C, 143), (signal.SIGINT, K, 130), (signal.SIGUSR1, C, 138), (None, X, 1)],
)
def test_an_exit_after_a_forwarded_stop_is_never_failed(
    forwarded: int | None, state: RunState, code: int
) -> None:
    ending = Ending(exit_code=1)  # a program that exits 1 on SIGTERM / Ctrl+C
    assert classify(ending, {}, forwarded=forwarded) is state
    assert exit_code_for(state, ending, {}, forwarded) == code
    # with a mark it is PREEMPTED, as without the forwarded stop
    assert classify(ending, RECORDS["stopping"], forwarded=forwarded) is P
    # and an exit 0 is still FINISHED: the job saved and ended on its own terms
    assert classify(Ending(exit_code=0), {}, forwarded=forwarded) is F


def test_exit_codes() -> None:
    assert exit_code_for(F, Ending(exit_code=0), {}, None) == 0
    assert exit_code_for(X, Ending(exit_code=3), {}, None) == 3
    assert exit_code_for(K, Ending(signal=2), {}, None) == 130
    assert exit_code_for(P, Ending(exit_code=0), {"signum": 10}, None) == 138
    assert exit_code_for(P, Ending(signal=15), {}, 12) == 140
    assert exit_code_for(P, Ending(exit_code=143), {}, None) == 143
    assert exit_code_for(P, Ending(exit_code=1), {}, None) == 143
    assert exit_code_for(C, Ending(signal=9), {}, None) == 137


def test_ending_needs_exactly_one_cause() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Ending(exit_code=0, signal=9)
    with pytest.raises(ValueError, match="exactly one"):
        Ending()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1:05", 65),
        ("2:00:00", 7200),
        ("1-00:00:10", 86410),
        ("UNLIMITED", None),
        ("INVALID", None),
        ("", None),
    ],
)
def test_parse_slurm_time_left(text: str, seconds: float | None) -> None:
    assert parse_time_left(text) == seconds
