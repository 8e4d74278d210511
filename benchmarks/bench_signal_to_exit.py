"""Time from SIGTERM to process exit for a 100 MB and a 1 GB state, split into phases.

A child process trains with 100 ms steps over a state of the given size and is sent SIGTERM
at a random moment of a step. Phases:
  wait    signal received -> step boundary reached (at most one step); with --bucket also
          the upload of the stop's checkpoint, which the exit waits for
  save    building the payload + torch.save + fsync + rename + fsync(dir)
  exit    exit_fn called -> process gone (interpreter and torch shutdown)
  total   signal sent (by this script) -> process gone (waitpid returned)

Beside the total, its ratio to the save measured in the same child: what the stop costs above
the save it has to make. ``--device cuda``: the state lives on the GPU (the save copies it to
host memory first; the exit also shuts CUDA down). ``--bucket``: each run also with its
checkpoints in a bucket on moto's S3 server (interleaved with the local runs); *gone/local* is
its signal -> gone over the local one's. ``--previous``: the child resumes from a checkpoint of
its own (saved by a handler before it), which the stop's save would retire under ``keep=1``.

    .venv/bin/python benchmarks/bench_signal_to_exit.py [--sizes 100,1000] [--repeats 5]
        [--device cpu|cuda] [--bucket] [--previous]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _common import disk_of, machine, median, s3_bucket, table

CHILD = r"""
import json, os, sys, time
import torch
import preemptible

size_mb, step_s, out, device = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[5]
weights = torch.nn.ParameterDict({
    f"w{i}": torch.nn.Parameter(torch.randn(size_mb * 2**20 // 4 // 8, device=device))
    for i in range(8)
})

default_exit = preemptible.TerminationConfig().exit_fn  # what a user gets: timed, then called

def exit_fn(code):
    t_exit = time.time()
    notice = handler.notices[0]
    json.dump({"received": notice.received_at, "exit_fn": t_exit, "raw": raw,
               "save": handler.save_times.max(), "code": code}, open(out, "w"))
    default_exit(code)

def raw_write():
    # the disk's limit for the same bytes, on the same disk, just before the loop (the disk's
    # mood then is the stop's): _common's, as every benchmark's
    sys.path.insert(0, sys.argv[7])
    from _common import write_and_fsync

    path = os.path.join(os.path.dirname(out), "raw.bin")
    t0 = time.perf_counter()
    write_and_fsync(path, sum(w.numel() * w.element_size() for w in weights.values()))
    seconds = time.perf_counter() - t0
    os.unlink(path)
    return seconds

if sys.argv[6] == "1":  # a run resumed from a checkpoint of its own: the stop's save retires it
    with preemptible.PreemptionCheckpointHandler(sys.argv[4], {"model": weights}) as first:
        first.save(1)
raw = raw_write()
handler = preemptible.PreemptionCheckpointHandler(
    sys.argv[4], {"model": weights}, keep=1,
    termination_config=preemptible.TerminationConfig(exit_fn=exit_fn))
ready = False
for step in handler.steps(10**9):
    if not ready:  # in the loop (a resume has loaded): the signal may come
        print("ready", flush=True)
        ready = True
    time.sleep(step_s)
"""


BARE_EXIT = r"""
import gc, os, signal, sys
import torch

size_mb, device, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
weights = [torch.randn(size_mb * 2**20 // 4 // 8, device=device) for _ in range(8)]

def leave(signum, frame):
    if how == "os._exit":
        os._exit(143)
    gc.freeze()  # the interpreter's shutdown without its full collections, as exit_process
    sys.exit(143)

signal.signal(signal.SIGTERM, leave)
print("ready", flush=True)
signal.pause()
"""


def bare_exit(size_mb: int, rng: random.Random, device: str, how: str) -> float:
    """Signal -> gone of a child holding the same state (torch imported, no preemptible)
    that leaves from its handler at once: ``how="os._exit"``, the kernel's teardown of its
    memory, the floor of any exit; ``"sys.exit"``, the interpreter's shutdown on top (torch's
    included), as fast as a Python program's own exit goes."""
    proc = subprocess.Popen(
        [sys.executable, "-c", BARE_EXIT, str(size_mb), device, how],
        stdout=subprocess.PIPE,
        text=True,
    )
    sent, gone = term_when_ready(proc, rng)
    return gone - sent


def term_when_ready(proc: subprocess.Popen[str], rng: random.Random) -> tuple[float, float]:
    """SIGTERM to ``proc`` at a random moment once it said ``ready`` (inside a step, for a
    child of ``one``); (sent, gone) by the wall clock, the exit code checked (143)."""
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", "the child did not start"
    time.sleep(rng.uniform(0.3, 0.5))
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=600)
    gone = time.time()
    assert code == 143, code
    return sent, gone


def one(
    size_mb: int,
    step_s: float,
    workdir: Path,
    rng: random.Random,
    device: str,
    url: str | None,
    previous: bool = False,
) -> dict[str, float]:
    """One child, its checkpoints in ``workdir`` or, with ``url``, in the bucket (staged in
    ``workdir``): the stop's save then waits for its upload before the exit."""
    out = workdir / "times.json"
    ckpt = url or str(workdir / "ckpt")
    env = {**os.environ, "PREEMPTIBLE_STAGING_DIR": str(workdir / "staging")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            str(size_mb),
            str(step_s),
            str(out),
            ckpt,
            device,
            str(int(previous)),
            str(Path(__file__).resolve().parent),  # where _common is
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    sent, gone = term_when_ready(proc, rng)
    t = json.loads(out.read_text())
    save = t["save"]
    return {
        "raw": t["raw"],
        "wait": t["exit_fn"] - save - t["received"],
        "save": save,
        "exit": gone - t["exit_fn"],
        "total": gone - sent,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="100,1000", help="state sizes in MB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--step", type=float, default=0.1, help="step time in seconds")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state is")
    p.add_argument(
        "--previous",
        action="store_true",
        help="the child resumes from a checkpoint of its own first (keep=1: the stop's save has "
        "one to retire)",
    )
    p.add_argument(
        "--bucket",
        action="store_true",
        help="also each run with its checkpoints in a bucket (moto's S3 server on 127.0.0.1, "
        "tests/services/s3.sh), interleaved with the local runs",
    )
    args = p.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    with contextlib.ExitStack() as stack:
        bucket = stack.enter_context(s3_bucket()) if args.bucket else None
        measure(args, bucket)


def measure(args: argparse.Namespace, bucket: str | None) -> None:
    rng = random.Random(0)
    rows = []
    base = args.dir or tempfile.gettempdir()
    wheres = ["local"] + (["bucket"] if bucket else [])
    for size in (int(s) for s in args.sizes.split(",")):
        runs: dict[str, list[dict[str, float]]] = {w: [] for w in wheres}
        for _ in range(args.repeats):
            for where in wheres:  # interleaved: the disk's and the machine's moods shared
                url = f"s3://{bucket}/run-{uuid.uuid4().hex[:8]}" if where == "bucket" else None
                with tempfile.TemporaryDirectory(dir=base) as d:
                    runs[where].append(
                        one(size, args.step, Path(d), rng, args.device, url, args.previous)
                    )
        for where in wheres:
            got = runs[where]
            med = {k: median([r[k] for r in got]) for k in got[0]}
            local = median([r["total"] for r in runs["local"]])
            rows.append(
                [
                    f"{size} MB",
                    where,
                    f"{med['raw']:.2f} s",
                    f"{med['wait'] * 1000:.0f} ms",
                    f"{med['save']:.2f} s",
                    f"{median([r['save'] / r['raw'] for r in got]):.2f}",
                    f"{size / med['save']:.0f} MB/s",
                    f"{med['exit']:.2f} s",
                    f"{med['total']:.2f} s",
                    f"{median([r['total'] / r['save'] for r in got]):.2f}",
                    f"{med['total'] / local:.2f}",
                ]
            )
    print(
        f"machine: {machine()}; disk {disk_of(base)}; step {args.step * 1000:.0f} ms; "
        f"state on {args.device}; median of {args.repeats}"
        + ("; bucket: moto's S3 server on 127.0.0.1" if bucket else "")
        + "\n"
    )
    header = ["state", "checkpoints", "raw write + fsync", "wait for boundary", "save"]
    header += ["save/raw", "save rate", "exit", "signal → gone", "gone/save", "gone/local"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
