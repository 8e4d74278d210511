"""The mirror's small decisions: how long a stop waits for its upload, and which checkpoints
form a family (the newest of each is brought back to a new machine)."""

from __future__ import annotations

import time

import pytest

from preemptible import Notice
from preemptible.checkpoint._mirror import EXIT_FLUSH_SECONDS, EXIT_MARGIN, _family, upload_deadline
from preemptible.stop._termination import StopRequests


def test_a_notice_with_a_deadline_bounds_the_upload_wait() -> None:
    requests = StopRequests()
    requests.add(Notice(source="gce", deadline=time.time() + 30))
    left = upload_deadline(requests) - time.monotonic()
    assert 30 - EXIT_MARGIN - 1 < left <= 30 - EXIT_MARGIN


def test_a_supervisor_s_kill_before_the_deadline_bounds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PREEMPTIBLE_GRACE_PERIOD=10: the supervisor escalates 2 s before it (kill_after 8)."""
    monkeypatch.setenv("PREEMPTIBLE_KILL_AFTER", "8")
    requests = StopRequests(grace_period=10)
    requests.add(Notice(source="SIGTERM", signum=15))
    left = upload_deadline(requests) - time.monotonic()
    assert 8 - EXIT_MARGIN - 1 < left <= 8 - EXIT_MARGIN


def test_a_grace_period_bounds_it_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREEMPTIBLE_KILL_AFTER", raising=False)
    requests = StopRequests(grace_period=10)
    requests.add(Notice(source="SIGTERM", signum=15))
    left = upload_deadline(requests) - time.monotonic()
    assert 10 - EXIT_MARGIN - 1 < left <= 10 - EXIT_MARGIN


def test_a_plain_signal_waits_for_the_upload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREEMPTIBLE_KILL_AFTER", raising=False)  # no supervisor
    requests = StopRequests()
    requests.add(Notice(source="SIGTERM", signum=15))
    left = upload_deadline(requests) - time.monotonic()
    assert EXIT_FLUSH_SECONDS - 1 < left <= EXIT_FLUSH_SECONDS


def test_under_a_supervisor_a_plain_signal_waits_until_just_before_its_kill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The supervisor SIGKILLs the group kill_after seconds after the stop it passed on:
    counted from the first signal's receipt, not from the flush."""
    monkeypatch.setenv("PREEMPTIBLE_KILL_AFTER", "8")
    requests = StopRequests()
    requests.add(Notice(source="stop file"))  # no signal: no kill follows it
    requests.add(Notice(source="SIGTERM", signum=15, received_at=time.time() - 2))
    requests.add(Notice(source="SIGINT", signum=2))
    left = upload_deadline(requests) - time.monotonic()
    assert 8 - 2 - EXIT_MARGIN - 1 < left <= 8 - 2 - EXIT_MARGIN


@pytest.mark.parametrize(
    ("kill_after", "notice"),
    [
        ("100000", Notice(source="SIGTERM", signum=15)),  # capped by the exit's own wait
        ("8", Notice(source="stop file")),  # a stop by no signal: the supervisor kills nothing
        ("soon", Notice(source="SIGTERM", signum=15)),  # not a supervisor's: ignored
        ("-3", Notice(source="SIGTERM", signum=15)),
    ],
)
def test_the_kill_bounds_only_a_signal_s_wait_and_never_lengthens_it(
    monkeypatch: pytest.MonkeyPatch, kill_after: str, notice: Notice
) -> None:
    monkeypatch.setenv("PREEMPTIBLE_KILL_AFTER", kill_after)
    requests = StopRequests()
    requests.add(notice)
    left = upload_deadline(requests) - time.monotonic()
    assert EXIT_FLUSH_SECONDS - 1 < left <= EXIT_FLUSH_SECONDS


@pytest.mark.parametrize(
    ("name", "family", "step"),
    [
        ("step-0000000028.ckpt", "step-#.ckpt", 28),
        ("checkpoint-500", "checkpoint-#", 500),
        ("epoch3-step-77", "epoch3-step-#", 77),
        ("resume.ckpt", "resume.ckpt", None),
    ],
)
def test_a_family_is_a_name_with_its_last_number_as_the_step(
    name: str, family: str, step: int | None
) -> None:
    key, pattern = _family(name)
    assert key == family
    if step is None:
        assert pattern is None
    else:
        assert pattern is not None
        m = pattern.match(name)
        assert m is not None and int(m.group(1)) == step
