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
    stops = () if forwarded is None else {forwarded}
    assert classify(ending, record, first_signal_at=9.0, stops=stops) is X
    assert exit_code_for(X, ending, record, forwarded) == 1
    marked_at_start = {**record, "preempting_at": 1.0}
    assert classify(ending, marked_at_start, stops=stops) is X
    # killed while it failed: the ending decides, as in the table
    assert classify(Ending(signal=signal.SIGKILL), record, first_signal_at=9.0) is C
    # cut short by a second signal, the record still says "stopping": PREEMPTED
    assert classify(ending, {**record, "state": "stopping"}, stops=stops) is P


def test_mark_after_the_supervisors_signal_is_not_a_mark_at_start() -> None:
    record = {"preempting": True, "preempting_at": 20.0}  # a user's SIGTERM handler marked it
    assert classify(Ending(signal=signal.SIGKILL), record, first_signal_at=19.0) is C
    assert classify(Ending(signal=signal.SIGKILL), record, first_signal_at=21.0) is P


STOPS = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP, signal.SIGUSR2]


@pytest.mark.parametrize("stop", STOPS, ids=lambda s: signal.Signals(s).name)
@pytest.mark.parametrize("record", ["none", "finished", "stopping"])
def test_an_attempt_a_stop_ended_is_preempted_wherever_the_stop_landed(
    stop: int, record: str
) -> None:
    """The supervisor passed ``stop`` on (or was asked for it): a death by it, any non-zero
    exit, or the supervisor's own SIGKILL is PREEMPTED, with no record (start-up, no handler),
    a finished one (after the loop) or a stop under way (during its save)."""
    rec = {
        "none": {},
        "finished": {"state": "finished", "step": 20},
        "stopping": {**RECORDS["stopping"], "state": "stopping", "signum": stop},
    }[record]
    for ending in (Ending(signal=stop), Ending(exit_code=1), Ending(exit_code=128 + stop)):
        state = classify(ending, rec, first_signal_at=10.0, stops={stop})
        assert state is P, ending
        assert exit_code_for(state, ending, rec, stop) == 128 + stop
    killed = Ending(signal=signal.SIGKILL)  # the escalation, a term timeout after the stop
    assert classify(killed, rec, first_signal_at=10.0, stops={stop}, killed=True) is P
    assert exit_code_for(P, killed, rec, stop) == 128 + stop
    # an exit 0 is FINISHED: the job ended on its own terms (PREEMPTED if it stopped early)
    finished = classify(Ending(exit_code=0), rec, stops={stop})
    assert finished is (P if record == "stopping" else F)


@pytest.mark.parametrize("record", ["none", "stopping"])
def test_a_signal_nobody_passed_on_is_what_it_was(record: str) -> None:
    """A death the supervisor's stop did not cause: the OOM killer's SIGKILL during the stop
    (the supervisor sent none), a segfault, a lost attempt; no stop at all: as before."""
    rec = RECORDS[record]
    oom = Ending(signal=signal.SIGKILL)
    assert classify(oom, rec, first_signal_at=9.0, stops={signal.SIGTERM}) is C
    segv = classify(Ending(signal=signal.SIGSEGV), rec, first_signal_at=9.0, stops={15})
    assert segv is (C if record == "none" else P)  # a stop under way: the marks decide
    assert classify(Ending(lost=True), rec, first_signal_at=9.0, stops={15}, killed=True) is C
    if record == "none":
        assert classify(Ending(signal=signal.SIGTERM), rec) is C
        assert classify(Ending(signal=signal.SIGINT), rec) is K
        assert classify(Ending(exit_code=1), rec) is X


def test_cancel_now_and_a_lost_lease_are_a_sigkill_asked_for() -> None:
    """``stop_job(SIGKILL)``: the attempt is PREEMPTED, its code 137; the queue makes a
    cancelled sweep's run CANCELLED whatever the attempt's state (``sweeps/_endings.py``)."""
    ending = Ending(signal=signal.SIGKILL)
    state = classify(ending, {}, first_signal_at=1.0, stops={signal.SIGKILL}, killed=True)
    assert state is P and exit_code_for(state, ending, {}, signal.SIGKILL) == 137


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
