"""What a line repeats of a bucket's writer.json: only what preemptible writes there."""

from __future__ import annotations

import os

import pytest

from preemptible._files import host_tag
from preemptible.checkpoint._manifest import named_writer, writer_name


def test_the_writer_is_named_by_host_pid_and_since() -> None:
    said = named_writer({"writer": writer_name(), "since": 0.5 * 2**31})
    assert said == (
        f"another writer (host {host_tag()}, pid {os.getpid()}, "
        "its writer since 2004-01-10 13:37:04 UTC)"
    )


@pytest.mark.parametrize(
    "writer",
    [
        None,
        {},
        {"writer": 7},
        {"writer": "host 12\\npreemptible: all is well"},
        {"writer": "host\n 12"},
        {"writer": "a" * 64 + " 12"},
        {"writer": "host 12 extra"},
    ],
)
def test_anything_else_in_writer_json_is_not_repeated(writer: object) -> None:
    assert named_writer(writer) == "another writer"  # type: ignore[arg-type]


@pytest.mark.parametrize("since", [None, "yesterday", -1, 1e300, float("nan"), True])
def test_a_time_that_is_not_one_is_left_out(since: object) -> None:
    said = named_writer({"writer": "node-7 4242", "since": since})
    assert said == "another writer (host node-7, pid 4242)"
