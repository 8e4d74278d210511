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


def test_a_grace_period_bounds_it_too() -> None:
    requests = StopRequests(grace_period=10)
    requests.add(Notice(source="SIGTERM", signum=15))
    left = upload_deadline(requests) - time.monotonic()
    assert 10 - EXIT_MARGIN - 1 < left <= 10 - EXIT_MARGIN


def test_a_plain_signal_waits_for_the_upload() -> None:
    requests = StopRequests()
    requests.add(Notice(source="SIGTERM", signum=15))
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
