"""preemptible.report(): metrics reach summary.json in the run directory, cheaply."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import preemptible
from preemptible import _report


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    _report._reset_for_tests()
    monkeypatch.setenv("PREEMPTIBLE_RUN_DIR", str(tmp_path))
    yield tmp_path
    _report._reset_for_tests()


def test_values_are_written_at_once_then_at_most_once_a_second(tmp_path: Path) -> None:
    preemptible.report(loss=0.5, step=1)
    assert _report.read_summary(tmp_path) == {"loss": 0.5, "step": 1}
    preemptible.report(loss=0.25)  # within the second: kept in memory
    assert _report.read_summary(tmp_path) == {"loss": 0.5, "step": 1}
    _report.flush()
    assert _report.read_summary(tmp_path) == {"loss": 0.25, "step": 1}


def test_tensors_and_numpy_scalars_are_numbers_and_nan_is_text(tmp_path: Path) -> None:
    import numpy as np

    preemptible.report(t=torch.tensor(1.5), n=np.float32(2.0), bad=float("nan"), ok=True)
    assert _report.read_summary(tmp_path) == {"t": 1.5, "n": 2.0, "bad": "nan", "ok": True}


@pytest.mark.parametrize(
    ("metrics", "says"),
    [
        ({"x": torch.ones(3)}, "report(x=...): Tensor is not a metric"),
        ({"x": object()}, "report(x=...): object is not a metric"),
        ({"x": [1, 2]}, "report(x=...): list is not a metric"),
        ({"x": "y" * 1001}, "at most 1000"),
    ],
)
def test_what_is_not_a_metric_is_one_clear_line(metrics: dict[str, object], says: str) -> None:
    with pytest.raises(preemptible.ConfigError) as err:
        preemptible.report(**metrics)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_without_a_supervisor_nothing_is_written(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("PREEMPTIBLE_RUN_DIR")
    preemptible.report(loss=1.0)
    assert _report.flush() is None
    assert not (tmp_path / _report.SUMMARY_NAME).exists()


@pytest.mark.timeout(60)
def test_the_last_values_are_written_when_the_process_exits(tmp_path: Path) -> None:
    code = "import preemptible\nfor i in range(1000):\n    preemptible.report(step=i)\n"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={"PREEMPTIBLE_RUN_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "summary.json").read_text()) == {"step": 999}


def test_an_odd_summary_file_reads_as_empty(tmp_path: Path) -> None:
    (tmp_path / "summary.json").mkdir()
    assert _report.read_summary(tmp_path) == {}


@pytest.mark.parametrize("huge", [10**400, -(10**400)], ids=["1e400", "-1e400"])
def test_a_number_a_float_cannot_hold_never_reaches_the_summary(tmp_path: Path, huge: int) -> None:
    """report(loss=10**400) is refused (one line naming the metric) or dropped: either way the
    summary a sweep agent reads holds only numbers a float can hold."""
    try:
        preemptible.report(loss=huge, ok=1)
    except preemptible.ConfigError as exc:
        assert "loss" in str(exc) and "\n" not in str(exc)
        preemptible.report(ok=1)
    _report.flush()
    summary = _report.read_summary(tmp_path)
    assert summary.get("ok") == 1
    for value in summary.values():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert math.isfinite(float(value)), summary


def _history(run_dir: Path) -> list[tuple[int, str, float]]:
    points, _ = _report.read_history(run_dir / _report.HISTORY_NAME)
    return points


def test_each_report_is_a_point_at_its_step_and_the_same_step_replaces(tmp_path: Path) -> None:
    preemptible.report(step=3, loss=1.0, acc=0.5, note="text", bad=float("nan"), ok=True)
    preemptible.report(step=3, loss=0.75)  # the same step: replaces loss there
    preemptible.report(step=4, loss=0.5)
    _report.flush()
    # the first report was written at once, the next two together: the file keeps the order,
    # and the queue keeps the last value of a step
    assert _history(tmp_path) == [
        (3, "acc", 0.5),
        (3, "loss", 1.0),
        (3, "loss", 0.75),
        (4, "loss", 0.5),
    ]
    assert _report.read_summary(tmp_path)["step"] == 4  # the summary keeps the last step


def test_without_step_a_report_follows_the_session_else_counts_on_from_the_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREEMPTIBLE_RESUME_FROM", str(tmp_path / "step-0000000120.ckpt"))
    preemptible.report(loss=1.0)
    preemptible.report(loss=2.0)

    class Session:
        step = 7

    session = Session()
    _report.follow_steps(session)
    preemptible.report(loss=3.0)
    del session  # held weakly: gone, the count goes on from the last point
    preemptible.report(loss=4.0)
    _report.flush()
    assert _history(tmp_path) == [
        (121, "loss", 1.0),
        (122, "loss", 2.0),
        (7, "loss", 3.0),
        (8, "loss", 4.0),
    ]


@pytest.mark.parametrize("step", [-1, 2**63, 1.5, True, "3"])
def test_a_step_that_is_not_a_step_is_one_clear_line(step: object) -> None:
    with pytest.raises(preemptible.ConfigError, match=r"report\(step=.*\): a step is an integer"):
        preemptible.report(step=step, loss=1.0)  # type: ignore[arg-type]


def test_history_lines_are_read_as_untrusted_whole_lines_and_on_from_an_offset(
    tmp_path: Path,
) -> None:
    path = tmp_path / "history.jsonl"
    good = json.dumps({"step": 1, "values": {"loss": 1.5}})
    hostile = [
        "not json",
        "[1, 2]",
        json.dumps({"step": -1, "values": {"loss": 1}}),
        json.dumps({"step": True, "values": {"loss": 1}}),
        json.dumps({"step": 2, "values": {"loss": "1", "x": None, "big": 10**400, "": 1}}),
        '{"step": 2, "values": {"inf": Infinity, "b": true}}',
        json.dumps({"step": 2, "values": [1]}),
    ]
    path.write_text("\n".join([good, *hostile, good]) + "\n" + '{"step": 3, "val')  # cut
    points, offset = _report.read_history(path)
    assert points == [(1, "loss", 1.5), (1, "loss", 1.5)]
    with path.open("a") as fh:
        fh.write('ues": {"loss": 0.5}}\n')
    more, end = _report.read_history(path, offset)
    assert more == [(3, "loss", 0.5)] and end == path.stat().st_size
    assert _report.read_history(path, end) == ([], end)


def test_a_history_path_that_is_not_a_regular_file_reads_as_nothing(tmp_path: Path) -> None:
    fifo = tmp_path / "history.jsonl"
    os.mkfifo(fifo)
    assert _report.read_history(fifo) == ([], 0)  # and does not block
    preemptible.report(step=1, loss=1.0)
    _report.flush()  # the writer does not block on it either, and says so once
    assert _report.read_history(tmp_path / "missing") == ([], 0)


def test_the_history_file_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_report, "MAX_HISTORY_BYTES", 2000)
    for step in range(200):
        preemptible.report(step=step, loss=float(step))
        _report.flush()
    size = (tmp_path / _report.HISTORY_NAME).stat().st_size
    assert 1000 < size <= 2000
    assert _report.read_summary(tmp_path)["step"] == 199  # the latest values go on
