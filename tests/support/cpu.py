"""Per-test CPU accounting, for balancing the integration tier's lanes (tests/services/lanes.sh).

With ``PREEMPTIBLE_TEST_CPU_LOG=FILE`` set, each test appends one JSON line to FILE: its node
id, its wall time (setup, call and teardown) and the CPU seconds it cost, the pytest process's
own plus those of the children it reaped meanwhile (the training processes, supervisors and
agents a test starts and waits for). A test whose CPU is a small part of its wall time mostly
waits on a clock and can share the machine; one near 1.0 (or above: torch uses both cores)
cannot. CPU time barely changes when the machine is busy, so the log is worth reading even
from a run beside other work. Daemons a test does not reap (PostgreSQL, slurmd) are not
counted. Unset, this costs nothing.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator

import pytest

_LOG = os.environ.get("PREEMPTIBLE_TEST_CPU_LOG")


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not _LOG:
        return (yield)
    wall, cpu = time.monotonic(), _cpu()
    try:
        return (yield)
    finally:
        wall, cpu = time.monotonic() - wall, _cpu() - cpu
        line = {"test": item.nodeid, "wall": round(wall, 2), "cpu": round(cpu, 2)}
        with open(_LOG, "a", encoding="utf-8") as log:
            log.write(json.dumps(line) + "\n")
