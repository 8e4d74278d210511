"""The run record is the job's word: checked on read, it can never crash the supervisor or
make a failed attempt exit 0."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from preemptible.supervisor import Ending, RunRecord, RunState, classify, exit_code_for
from preemptible.supervisor._record import load_record

KEYS = ["state", "preempting", "preempting_at", "stopped_at", "signum", "step", "checkpoint"]
KEYS += ["checkpoint_dir", "reason", "pid", "updated_at"]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["stopping", "stopped", "finished", "15", "SIGTERM"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
records = st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), json_values) | json_values
endings = st.one_of(
    st.builds(Ending, exit_code=st.integers(0, 255)),
    st.builds(Ending, signal=st.integers(1, 64)),
    st.just(Ending(lost=True)),
)
times = st.none() | st.floats(-1e12, 1e12)
stops = st.none() | st.sampled_from([int(s) for s in signal.valid_signals() if 0 < s <= 64])


@settings(max_examples=200, deadline=None)
@given(
    raw=records, ending=endings, first_at=times, forwarded=stops, stop=stops, killed=st.booleans()
)
def test_any_record_classifies_without_error_and_only_finished_exits_0(
    raw: Any,
    ending: Ending,
    first_at: float | None,
    forwarded: int | None,
    stop: int | None,
    killed: bool,
) -> None:
    record = RunRecord.from_json(raw)
    received = () if forwarded is None else {forwarded}
    state = classify(ending, record, first_signal_at=first_at, stops=received, killed=killed)
    code = exit_code_for(state, ending, record, stop)
    assert 0 <= code <= 255
    assert (code == 0) == (state is RunState.FINISHED)
    if state is RunState.FINISHED:
        assert ending.exit_code == 0
    if ending.exit_code != 0:  # a failure or a crash stays non-zero whatever the record says
        assert code != 0
    # the supervisor passes the raw record straight in: the same answer
    if isinstance(raw, dict):
        again = classify(ending, raw, first_signal_at=first_at, stops=received, killed=killed)
        assert again is state


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"state": "stopped", "signum": 15, "step": 7}, RunRecord("stopped", signum=15, step=7)),
        ({"signum": 128}, RunRecord()),
        ({"signum": -128}, RunRecord()),
        ({"signum": "15"}, RunRecord()),
        ({"signum": 1e9}, RunRecord()),
        ({"signum": True}, RunRecord()),
        ({"preempting_at": "yesterday", "stopped_at": math.inf}, RunRecord()),
        ({"preempting_at": 10**400}, RunRecord()),
        ({"preempting_at": 12}, RunRecord(preempting_at=12.0)),
        ({"state": "STOPPED"}, RunRecord()),
        ({"step": -1, "checkpoint": 3}, RunRecord()),
        ({"checkpoint": "a\nINFO forged line"}, RunRecord()),
        ({"checkpoint_dir": "/x\x00y"}, RunRecord()),
        ({"checkpoint_dir": "/data/ck"}, RunRecord(checkpoint_dir="/data/ck")),
        ([{"state": "stopped"}], RunRecord()),
        ("stopped", RunRecord()),
        (None, RunRecord()),
    ],
)
def test_sanitize(raw: object, expected: RunRecord) -> None:
    assert RunRecord.from_json(raw) == expected


def _fifo(path: Path) -> None:
    os.mkfifo(path)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "make",
    [
        lambda p: p.mkdir(),
        lambda p: p.write_bytes(b'{"state": "stopped", "checkpoint": "\xff\xfe"}'),
        lambda p: p.write_bytes(b'{"state": "stopped", "reason": "' + b"x" * (3 << 20) + b'"}'),
        lambda p: p.write_text("[" * 100_000),
        lambda p: p.write_text('{"step": 1' + "0" * 5000 + "}"),
        _fifo,  # opening a FIFO for reading would block until a writer comes
        lambda p: p.symlink_to("/dev/zero"),
    ],
    ids=["directory", "invalid-utf8", "huge", "deep", "long-int", "fifo", "device"],
)
def test_odd_record_files_read_as_empty(make: Any, tmp_path: Path) -> None:
    make(tmp_path / "record.json")
    assert load_record(tmp_path) == RunRecord()


def test_a_real_record_reads_back(tmp_path: Path) -> None:
    record = {"state": "stopped", "signum": 10, "step": 3, "checkpoint": "/c/step-3.ckpt"}
    (tmp_path / "record.json").write_text(json.dumps({**record, "pid": 1, "reason": "SIGUSR1"}))
    assert load_record(tmp_path) == RunRecord(**record)  # type: ignore[arg-type]
