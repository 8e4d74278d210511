"""SLURM's own SIGKILL deadline, the supervisor's escalation under SLURM, and SLURM job ids.

A fake ``scontrol`` (tests/support/slurm.py) answers, fails or hangs; every call is a real
subprocess.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from preemptible import ConfigError
from preemptible.supervisor import _slurm, term_timeout
from preemptible.supervisor._deadlines import kill_after
from tests.conftest import wait_for
from tests.support.slurm import FakeScontrol, slurm_time

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def clean(clean_platform_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_slurm, "_kill_wait", [], raising=False)
    monkeypatch.setattr(_slurm, "_stuck", [], raising=False)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeScontrol:
    fake = FakeScontrol(tmp_path / "bin")
    monkeypatch.setenv("PATH", fake.env()["PATH"])
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    return fake


NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("job", "seconds", "near"),
    [
        # plain scancel, a requeue: the job has left RUNNING, SIGKILL KillWait after the TERM
        ({"JobState": "COMPLETING", "EndTime": slurm_time(NOW)}, 5.0, True),
        ({"JobState": "CANCELLED", "EndTime": slurm_time(NOW)}, 5.0, True),
        # the time limit: slurmctld's check runs late, EndTime is already past
        ({"JobState": "RUNNING", "EndTime": slurm_time(NOW - 20)}, 5.0, True),
        # a --signal warning 120 s before the limit
        ({"JobState": "RUNNING", "EndTime": slurm_time(NOW + 120)}, 125.0, True),
        # picked for preemption: EndTime = preempt time + GraceTime, however long
        (
            {
                "JobState": "RUNNING",
                "EndTime": slurm_time(NOW + 900),
                "PreemptTime": slurm_time(NOW),
            },
            905.0,
            True,
        ),
        # days left: SLURM is not ending the job
        ({"JobState": "RUNNING", "EndTime": slurm_time(NOW + 86400)}, 86405.0, False),
        ({"JobState": "RUNNING", "EndTime": "Unknown", "PreemptTime": "None"}, float("inf"), False),
        ({}, 5.0, True),  # nothing readable: the earliest SLURM ever kills
    ],
)
def test_deadline_from_the_job(job: dict[str, str], seconds: float, near: bool) -> None:
    found = _slurm.deadline_from(5.0, job, now=NOW)
    assert (found.seconds, found.near) == (seconds, near), found


def test_escalation_comes_before_slurms_kill_after_a_scancel(fake: FakeScontrol) -> None:
    fake.answer(kill_wait=5, state="COMPLETING", end=time.time())
    seconds, source = term_timeout()
    assert seconds == 3.0
    assert source == "2 s before SLURM's own SIGKILL: KillWait=5 s, job COMPLETING"
    assert fake.calls == ["show config", "show job -o 12"]
    term_timeout()
    assert fake.calls.count("show config") == 1, "KillWait is read once"


def test_a_short_killwait_escalates_halfway(fake: FakeScontrol) -> None:
    fake.answer(kill_wait=1, state="COMPLETING", end=time.time())
    assert term_timeout()[0] == 0.5


def test_a_signal_warning_gets_the_time_left_plus_killwait(fake: FakeScontrol) -> None:
    fake.answer(kill_wait=30, state="RUNNING", end=time.time() + 100)
    seconds, source = term_timeout()
    assert 126 <= seconds <= 128, source
    assert "time limit in" in source and "KillWait=30 s" in source


def test_a_far_end_keeps_the_default(fake: FakeScontrol) -> None:
    fake.answer(state="RUNNING", end=time.time() + 86400)
    assert term_timeout() == (60.0, "the default; set --term-timeout")


def test_explicit_wins_with_a_warning_when_slurm_kills_first(
    fake: FakeScontrol, caplog: pytest.LogCaptureFixture
) -> None:
    fake.answer(kill_wait=5, state="TIMEOUT", end=time.time() - 10)
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        assert term_timeout(60.0) == (60.0, "--term-timeout")
    [record] = caplog.records
    assert "--term-timeout 60 s is longer than SLURM allows here" in record.getMessage()
    assert "Use --term-timeout 3 or less" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        assert term_timeout(2.0) == (2.0, "--term-timeout")
    assert not caplog.records


def test_a_grace_period_longer_than_killwait_is_cut_to_slurms(
    fake: FakeScontrol, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake.answer(kill_wait=10, state="COMPLETING", end=time.time())
    monkeypatch.setenv("PREEMPTIBLE_GRACE_PERIOD", "30")
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        seconds, source = term_timeout()
    assert seconds == 8.0 and "KillWait=10 s" in source
    assert "PREEMPTIBLE_GRACE_PERIOD=30 s is longer than SLURM allows" in caplog.text
    monkeypatch.setenv("PREEMPTIBLE_GRACE_PERIOD", "6")
    assert term_timeout() == (4.0, "PREEMPTIBLE_GRACE_PERIOD minus 2 s")


def test_unreadable_job_assumes_it_is_ending(fake: FakeScontrol) -> None:
    fake.answer(kill_wait=5)
    (fake.dir / "job").unlink()
    seconds, source = term_timeout()
    assert seconds == 3.0 and "job state unknown" in source


def test_no_scontrol_falls_back(fake: FakeScontrol, caplog: pytest.LogCaptureFixture) -> None:
    fake.mode("fail")
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        assert term_timeout() == (60.0, "the default; set --term-timeout")
    assert "cannot read SLURM's KillWait: scontrol show config failed (exit 1)" in caplog.text


def test_hung_scontrol_is_killed_with_its_group_and_not_asked_again(
    fake: FakeScontrol, caplog: pytest.LogCaptureFixture
) -> None:
    fake.mode("hang")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        assert term_timeout() == (60.0, "the default; set --term-timeout")
    took = time.monotonic() - started
    assert _slurm.TIMEOUT <= took < _slurm.TIMEOUT + 3, took
    assert "scontrol show config did not answer within 3 s" in caplog.text
    sleeper = int((fake.dir / "sleep.pid").read_text())
    stat = Path(f"/proc/{sleeper}/stat")

    def gone() -> bool:  # SIGKILL was sent to the group; on a busy machine it lands a moment later
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True

    wait_for(gone, 5, "scontrol's child to be killed with its group")
    started = time.monotonic()
    assert term_timeout()[0] == 60.0
    assert time.monotonic() - started < 1.0, "a stuck controller is not waited for twice"
    assert fake.calls == ["show config"]


def test_an_attempt_is_told_the_shortest_kill_slurm_can_bring(fake: FakeScontrol) -> None:
    """At an attempt's start SLURM is not ending the job (the default 60 s), but a scancel
    later makes the escalation KillWait - 2 s: the attempt counts on that."""
    fake.answer(kill_wait=30, state="RUNNING", end=time.time() + 86400)
    assert (term_timeout()[0], kill_after()) == (60.0, 28.0)
    assert kill_after(8.0) == 8.0  # an explicit --term-timeout is the supervisor's word
    # near the time limit: a --signal warning's stop may get 126 s, a scancel's only 28 s
    fake.answer(kill_wait=30, state="RUNNING", end=time.time() + 100)
    assert kill_after() == 28.0


def test_outside_slurm_nothing_is_asked(fake: FakeScontrol, monkeypatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID")
    assert term_timeout() == (60.0, "the default; set --term-timeout")
    assert kill_after() == 60.0
    assert fake.calls == []


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SLURM_JOB_ID": "/../../x"}, "SLURM_JOB_ID='/../../x' is not valid"),
        ({"SLURM_JOB_ID": "12 "}, "SLURM_JOB_ID='12 ' is not valid"),
        ({"SLURM_JOB_ID": "-5"}, "SLURM_JOB_ID='-5' is not valid"),
        (
            {"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "../1"},
            "SLURM_ARRAY_TASK_ID='../1' is not valid",
        ),
        (
            {"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "1_0", "SLURM_ARRAY_TASK_ID": "1"},
            "SLURM_ARRAY_JOB_ID='1_0' is not valid",
        ),
    ],
)
def test_job_ids_are_digits(env: dict[str, str], message: str, monkeypatch) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="SLURM job ids are digits") as info:
        _slurm.job_id()
    assert str(info.value).startswith(message)


def test_job_ids(monkeypatch) -> None:
    assert _slurm.job_id() is None
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    assert _slurm.job_id() == "12"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "10")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert _slurm.job_id() == "10_3"


def test_requeue_mode(monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    assert _slurm.in_batch_job()
    monkeypatch.setenv("PREEMPTIBLE_REQUEUE", "never")
    assert not _slurm.in_batch_job()
    monkeypatch.setenv("PREEMPTIBLE_REQUEUE", "always")
    with pytest.raises(ConfigError, match="PREEMPTIBLE_REQUEUE='always' is not valid; use one of"):
        _slurm.in_batch_job()


def test_requeue_reports_scontrols_answer(
    fake: FakeScontrol, caplog: pytest.LogCaptureFixture
) -> None:
    fake.mode("fail")
    with caplog.at_level(logging.ERROR, logger="preemptible"):
        assert not _slurm.requeue()
    assert "scontrol requeue 12 failed (exit 1): slurm_load_jobs error" in caplog.text
    assert fake.calls[-1] == "requeue 12"  # the job could not be read either: requeued


@pytest.mark.parametrize(
    ("state", "reason", "preempt", "requeued"),
    [
        ("RUNNING", "None", None, True),  # a USR1 from --signal, a notice: the job runs on
        ("COMPLETING", "TimeLimit", None, True),  # its time limit: the run continues
        ("COMPLETING", "None", 1.0, True),  # picked for preemption
        ("COMPLETING", "None", None, False),  # a plain scancel: the job is to end
        ("CANCELLED", "None", None, False),
    ],
)
def test_a_cancelled_job_is_not_requeued(
    fake: FakeScontrol,
    caplog: pytest.LogCaptureFixture,
    state: str,
    reason: str,
    preempt: float | None,
    requeued: bool,
) -> None:
    fake.answer(state=state, reason=reason, preempt=preempt)
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        assert _slurm.requeue() is requeued
    assert ("requeue 12" in fake.calls) is requeued, fake.calls
    assert ("was cancelled (scancel): not requeued" in caplog.text) is not requeued
