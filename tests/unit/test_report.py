"""preemptible.report(): metrics reach summary.json in the run directory, cheaply."""

from __future__ import annotations

import json
import math
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
