"""A run that reports many metrics as fast as it can: ``--steps`` steps of ``--metrics``
metrics each with ``preemptible.report`` in a tight loop (the metric flood of issue 31), then
``--hold`` more seconds of work that reports nothing (an evaluation, an export). It ends by
writing ``ended.json`` (``{"at": wall time}``) into its attempt's directory and exiting 0; its
history file holds exactly ``steps * metrics`` points. No handler: a stop kills it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import preemptible
from preemptible._report import flush


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--metrics", type=int, default=500)
    p.add_argument("--hold", type=float, default=0.0)
    args = p.parse_args()
    names = [f"metric_{i:03d}" for i in range(args.metrics)]
    for step in range(args.steps):
        preemptible.report(step=step, **{name: step + i / 1000 for i, name in enumerate(names)})
    flush()  # the last of the flood in the file now, not at exit
    until = time.monotonic() + args.hold
    while time.monotonic() < until:
        time.sleep(0.05)  # work that reports nothing
    run_dir = Path(os.environ["PREEMPTIBLE_RUN_DIR"])
    (run_dir / "ended.json").write_text(json.dumps({"at": time.time()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
