"""The gate a Ctrl+Z closes between transactions, and the reading of /proc/locks that names a
stopped holder of an SQLite file's write lock."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from preemptible.sweeps.store._pause import Gate
from preemptible.sweeps.store._sqlite import write_lock_holders


def test_the_gate_closes_only_once_the_transactions_under_way_end() -> None:
    gate = Gate()
    inside, leave, entered_late = threading.Event(), threading.Event(), threading.Event()

    def transaction() -> None:
        with gate.passage(), gate.passage():  # one opened inside another passes again
            inside.set()
            leave.wait(10)

    def late() -> None:
        with gate.passage():
            entered_late.set()

    first = threading.Thread(target=transaction)
    first.start()
    assert inside.wait(10)
    threading.Timer(0.2, leave.set).start()
    started = time.monotonic()
    with gate.closed(10) as idle:
        assert idle and time.monotonic() - started >= 0.15
        second = threading.Thread(target=late)
        second.start()
        assert not entered_late.wait(0.2)  # no transaction starts while it is closed
    assert entered_late.wait(10)
    first.join(10)
    second.join(10)


def test_a_closed_gate_stops_waiting_after_its_limit() -> None:
    gate = Gate()
    release = threading.Event()
    inside = threading.Event()

    def stuck() -> None:
        with gate.passage():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=stuck)
    thread.start()
    assert inside.wait(10)
    started = time.monotonic()
    with gate.closed(0.1) as idle:
        assert not idle and time.monotonic() - started < 5
    release.set()
    thread.join(10)


def test_the_write_lock_holder_is_read_from_proc_locks(tmp_path: Path) -> None:
    import os

    shm = tmp_path / "q.db-shm"
    shm.write_bytes(b"")
    st = os.stat(shm)
    file = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    locks = tmp_path / "locks"
    locks.write_text(
        f"1: POSIX  ADVISORY  WRITE 3665 {file} 120 120\n"
        f"1: -> POSIX  ADVISORY  WRITE 3700 {file} 120 120\n"  # a waiter, not a holder
        f"2: POSIX  ADVISORY  READ 3665 {file} 124 124\n"
        f"3: POSIX  ADVISORY  WRITE 4000 {file} 0 EOF\n"
        f"4: POSIX  ADVISORY  WRITE 4100 {file} 121 130\n"  # another byte
        "5: POSIX  ADVISORY  WRITE 4200 00:01:99 120 120\n"  # another file
        "6: FLOCK  ADVISORY  WRITE 4300 junk\n"
    )
    assert write_lock_holders(shm, locks) == [3665, 4000]
    assert write_lock_holders(tmp_path / "missing-shm", locks) == []
