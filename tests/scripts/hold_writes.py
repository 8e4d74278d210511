"""Writes to a sweep database without pause, as an agent's threads do, only far more often:
three threads, each in a write transaction nearly all the time (each updates row 1 of one
table and keeps its transaction open a few milliseconds). SIGTSTP is taken as the
agent takes it (``CtrlZ``); SIGTERM ends it (exit 0, after printing how many transactions
committed).

    python hold_writes.py DB_URL
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from preemptible.sweeps.store._pause import CtrlZ
from preemptible.sweeps.store._queue import open_store

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line


def main() -> None:
    url = sys.argv[1]
    store = open_store(url)
    store._transact(
        lambda tx: [
            tx.execute("CREATE TABLE IF NOT EXISTS hammer (id INTEGER PRIMARY KEY, n INTEGER)"),
            tx.execute("INSERT INTO hammer (id, n) VALUES (1, 0) ON CONFLICT DO NOTHING"),
        ]
    )
    done: list[int] = []  # a list, not an Event: the handler must take no lock
    signal.signal(signal.SIGTERM, lambda signum, frame: done.append(signum))
    ctrl_z = CtrlZ()
    ctrl_z.install()
    counts = [0, 0, 0]

    def write(tx) -> None:  # type: ignore[no-untyped-def]
        tx.execute("UPDATE hammer SET n = n + 1 WHERE id = 1")
        time.sleep(0.005)  # inside the transaction, as a slow client would be

    def hammer(k: int) -> None:
        mine = store if k == 0 else store.reopen()
        while not done:
            mine._transact(write)
            counts[k] += 1

    # the main thread only waits, so that it runs the signal handlers at once: waiting for
    # the write lock in SQLite's busy handler it would run them only when that wait ends
    threads = [threading.Thread(target=hammer, args=(k,)) for k in (0, 1, 2)]
    for t in threads:
        t.start()
    print("up", flush=True)
    while not done:
        time.sleep(0.05)
    for t in threads:
        t.join()
    print(f"committed {sum(counts)}", flush=True)


if __name__ == "__main__":
    main()
