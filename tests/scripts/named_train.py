"""A front end of one's own on the kit, with a checkpoint format of its own: ``model.txt``.

Each step adds the step number to a running sum; the checkpoint is the sum as text, committed by
the kit's ``NamedSaver`` under a fixed name. Prints ``step N`` as a step starts and, when told
where to resume from, ``resume from PATH``. Exits as the kit decides on a stop.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from preemptible.frontend import CheckpointStore, NamedSaver, Phase, StopSession

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sleep", type=float, default=0.05)
    args = p.parse_args()
    total = [0]

    def write(tmp: Path, step: int, context: Any) -> None:
        tmp.write_text(f"{step} {total[0]}\n")

    saver = NamedSaver(CheckpointStore(args.dir), "model.txt", write)
    session = StopSession(saver)
    session.start()
    step = 0
    hint = os.environ.get("PREEMPTIBLE_RESUME_FROM")
    if hint:
        print(f"resume from {hint}", flush=True)
        done, value = Path(hint).read_text().split()
        step, total[0] = int(done), int(value)
        session.note_saved(Path(hint), step=step, resumed=True)
    try:
        while step < args.steps:
            print(f"step {step}", flush=True)
            total[0] += step
            time.sleep(args.sleep)
            step += 1
            session.at_boundary(Phase.STEP, step=step)
        session.finished(step=step)
    finally:
        session.close()
    print(f"total {total[0]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
