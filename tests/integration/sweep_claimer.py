"""A worker process for the sweep store's concurrency tests.

--mode claim   claim, "run" (--work seconds), finish FINISHED, until nothing is left to claim;
               every claimed (run, attempt) is appended to --log before it is finished, so the
               test counts executions across agents (a run executed twice shows up twice)
--mode expire  call expire_leases() twice, a little more than the lease apart
               (``expire_twice``); print the requeued run ids as JSON
--mode open    open the store (creating and migrating the database); print "opened"

With --go FILE the worker prints "ready" and waits for FILE to exist before it acts, so that
several workers act at the same moment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from preemptible.sweeps.store._queue import Store, open_store


def wait_for_go(go: str | None) -> None:
    print("ready", flush=True)
    if go is not None:
        while not Path(go).exists():
            time.sleep(0.001)


def claim_loop(args: argparse.Namespace) -> None:
    store = open_store(args.db)
    wait_for_go(args.go)
    done = 0
    with open(args.log, "a", buffering=1) as log:
        while True:
            claim = store.claim(
                args.sweep, agent=args.agent, host=os.uname().nodename, lease=60, propose=None
            )
            if claim is None:
                break
            log.write(f"{claim.run_id} {claim.attempt} {args.agent}\n")
            if args.work:
                time.sleep(args.work)  # the run's work, not a synchronisation
            state = store.finish(
                claim.run_id,
                agent=args.agent,
                attempt=claim.attempt,
                ending="FINISHED",
                exit_code=0,
                duration=args.work,
                checkpoint_step=None,
                summary={"done": 1},
            )
            assert state == "FINISHED", state
            done += 1
    store.close()
    print(f"done {done}", flush=True)


def expire_twice(store: Store) -> list[str]:
    """The runs ``store`` takes over in two looks a little more than the lease apart: on
    SQLite an agent judges a lease by the renewals it sees over its own time (a first look
    only starts watching: ``sweeps/_watch.py``); PostgreSQL takes them at the first."""
    first = store.expire_leases()
    time.sleep(0.01)  # the leases' length (1 ms) and margin, on this process's clock
    return first + store.expire_leases()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--mode", choices=["claim", "expire", "open"], default="claim")
    parser.add_argument("--sweep")
    parser.add_argument("--agent", default=f"agent-{os.getpid()}")
    parser.add_argument("--log")
    parser.add_argument("--go")
    parser.add_argument("--work", type=float, default=0.0, help="seconds each run takes")
    args = parser.parse_args()
    if args.mode == "claim":
        claim_loop(args)
    elif args.mode == "expire":
        store = open_store(args.db)
        wait_for_go(args.go)
        print(json.dumps(expire_twice(store)), flush=True)
        store.close()
    else:
        wait_for_go(args.go)
        open_store(args.db).close()
        print("opened", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
