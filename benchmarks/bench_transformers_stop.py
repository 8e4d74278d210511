"""A Hugging Face Trainer run stopped by a signal: no handling, ``enable_jit_checkpoint``, and
``PreemptionCallback``, side by side on one script (``tests/scripts/hf_train.py``: a 2-layer
GPT-2 from a config, dropout 0.1, 60 steps of about 100 ms: the stop comes 4 s or more before
the end, longer than ``enable_jit_checkpoint``'s fixed 3 s timer).

Each variant is sent each signal at a random step (the same steps for every variant, the
variants interleaved). Reported per variant and signal: the exit code, seconds from the signal
to the process's exit (the parent's waitpid; median and worst), whether a ``checkpoint-N`` was
written, and whether ``train(resume_from_checkpoint=get_last_checkpoint(out))`` then ends with
the weights of a run never stopped, bit for bit ("from 0": nothing was saved, the rerun trains
it all again).

    .venv/bin/python benchmarks/bench_transformers_stop.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import machine, median, table

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "scripts" / "hf_train.py")
STEPS = 60
VARIANTS = {
    "no handling": ["--no-callback"],
    "enable_jit_checkpoint": ["--no-callback", "--jit"],
    "PreemptionCallback": [],
}
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def run(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, SCRIPT, str(out), "--steps", str(STEPS), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )


def stopped(out: Path, extra: list[str], sig: int, at: int) -> tuple[int, float]:
    child = subprocess.Popen(
        [sys.executable, SCRIPT, str(out), "--steps", str(STEPS), "--sleep", "0.1", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert child.stdout is not None
    sent = None
    for line in child.stdout:
        if line.strip() == f"step {at}":
            child.send_signal(sig)
            sent = time.monotonic()
            break
    child.stdout.read()
    rc = child.wait(timeout=120)
    assert sent is not None, "the run ended before the signal"
    return rc, time.monotonic() - sent


def same(a: Path, b: Path) -> bool:
    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    # a shell's background job ignores SIGINT, and so would the runs (preemptible keeps an
    # ignored SIGINT ignored, as nohup asks): they start with the default action instead
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = random.Random(0)
    results: dict[tuple[str, int], list[tuple[int, float, bool, str]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        ref = base / "ref.pt"
        done = run(base / "ref", "--no-callback", "--weights", str(ref))
        assert done.returncode == 0, done.stderr
        n = 0
        for _ in range(args.repeats):
            for sig in SIGNALS:
                at = rng.randint(3, STEPS - 40)
                for name, extra in VARIANTS.items():
                    n += 1
                    out = base / f"run{n}"
                    rc, seconds = stopped(out, extra, sig, at)
                    saved = any(out.glob("checkpoint-*"))
                    again = run(out, *extra, "--resume", "--weights", str(out / "w.pt"))
                    if again.returncode != 0:
                        exact = f"resume failed ({again.returncode})"
                    elif not saved:
                        exact = "from 0"
                    else:
                        exact = "exact" if same(ref, out / "w.pt") else "differs"
                    results.setdefault((name, sig), []).append((rc, seconds, saved, exact))
    rows = []
    for (name, sig), got in results.items():
        codes = sorted({r[0] for r in got})
        secs = [r[1] for r in got]
        exact = sorted({r[3] for r in got})
        rows.append(
            [
                name,
                signal.Signals(sig).name,
                ", ".join(map(str, codes)),
                f"{median(secs):.2f} / {max(secs):.2f}",
                f"{sum(r[2] for r in got)}/{len(got)}",
                ", ".join(exact) + f" ({sum(r[3] == 'exact' for r in got)}/{len(got)})",
            ]
        )
    print(machine())
    print(f"{args.repeats} repeats per cell, the stop step random in 3..{STEPS - 40}")
    print(
        table(
            [
                "variant",
                "signal",
                "exit code",
                "signal→exit s (median / worst)",
                "checkpoint",
                "resume",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
