"""A Keras fit stopped mid-epoch and run again: preemptible's PreemptionCallback against
``keras.callbacks.BackupAndRestore(save_freq=N)``, on the same script (torch backend, CPU).

The fit: 3 epochs of 20 batches, 50 ms each (a sleep in ``train_step``), dropout,
``shuffle=True``. SIGTERM lands 20 ms into a random batch of the second epoch (batches 5-15);
the same command then runs to the end. Reported for each, median (and range) of --repeats:

- signal → exit: SIGTERM to the parent's waitpid, and the exit code;
- replayed: batches the resumed run trained again (they were trained before the stop too),
  as a share of an epoch;
- exact: whether the resumed fit's weights equal an uninterrupted fit's bit for bit.

    .venv/bin/python benchmarks/bench_keras_resume.py [--repeats 3] [--save-freq 5]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, median, table

BATCHES = 20
CHILD = r"""
import os, sys, time
os.environ["KERAS_BACKEND"] = "torch"
import numpy as np, keras, torch
torch.set_num_threads(1)
how, d, out, freq = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
keras.utils.set_random_seed(0)
x = np.random.RandomState(1).randn(160, 8).astype("float32"); y = x.sum(1, keepdims=True)
where = [0, 0]

class M(keras.Sequential):
    def train_step(self, data):
        print(f"trained {where[0]} {where[1]}", flush=True)
        time.sleep(0.05)
        return super().train_step(data)

class Where(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None): where[0] = epoch
    def on_train_batch_begin(self, batch, logs=None): where[1] = batch

model = M([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
           keras.layers.Dropout(0.2), keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
if how == "ours":
    from preemptible.keras import PreemptionCallback
    cb = PreemptionCallback(d)
elif how == "bar":
    cb = keras.callbacks.BackupAndRestore(d, save_freq=freq)
else:
    cb = keras.callbacks.Callback()
model.fit(x, y, batch_size=8, epochs=3, shuffle=True, callbacks=[Where(), cb], verbose=0)
np.savez(out, *[keras.ops.convert_to_numpy(v) for v in model.variables])
"""
HOW = {"ours": "PreemptionCallback", "bar": "BackupAndRestore(save_freq={freq})"}


def run(how: str, d: str, out: str, freq: int, stop_at: int | None) -> tuple[list[str], int, float]:
    """The child's ``trained E B`` lines, its exit code, and seconds from SIGTERM to exit."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, how, d, out, str(freq)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    lines, sent = [], 0.0
    for line in proc.stdout:
        lines.append(line.strip())
        if stop_at is not None and not sent and line.strip() == f"trained 1 {stop_at}":
            time.sleep(0.02)  # into the batch
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
    rc = proc.wait()
    return lines, rc, (time.monotonic() - sent) if sent else 0.0


def trained(lines: list[str]) -> list[tuple[int, int]]:
    """(epoch, batch) of every batch a run trained."""
    return [
        (int(e), int(b)) for _, e, b in (ln.split() for ln in lines if ln.startswith("trained"))
    ]


def same(a: str, b: str) -> bool:
    import numpy as np

    with np.load(a) as wa, np.load(b) as wb:
        return all(np.array_equal(wa[k], wb[k]) for k in wa.files)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--save-freq", type=int, default=5)
    args = p.parse_args()
    rng = random.Random(0)
    results: dict[str, list[tuple[float, int, int, bool]]] = {h: [] for h in HOW}
    with tempfile.TemporaryDirectory() as base:
        ref = os.path.join(base, "ref.npz")
        run("none", os.path.join(base, "none"), ref, args.save_freq, None)
        for r in range(args.repeats):
            stop_at = rng.randrange(5, 16)
            for how in list(HOW) if r % 2 == 0 else list(HOW)[::-1]:
                d, out = os.path.join(base, f"{how}-{r}"), os.path.join(base, f"{how}-{r}.npz")
                first, rc, seconds = run(how, d, out, args.save_freq, stop_at)
                second, rc2, _ = run(how, d, out, args.save_freq, None)
                assert rc2 == 0 and Path(out).exists(), (how, rc2)
                done = set(trained(first))
                replayed = sum(1 for pos in trained(second) if pos in done)
                results[how].append((seconds, rc, replayed, same(ref, out)))
    rows = []
    for how, res in results.items():
        secs = [s for s, *_ in res]
        replay = [rep for _, _, rep, _ in res]
        rows.append(
            [
                HOW[how].format(freq=args.save_freq),
                f"{median(secs):.2f} s ({min(secs):.2f}-{max(secs):.2f})",
                ", ".join(sorted({str(rc) if rc >= 0 else f"killed ({rc})" for _, rc, *_ in res})),
                f"{median(replay):.0f} of {BATCHES} ({median(replay) / BATCHES:.0%}; "
                f"{min(replay)}-{max(replay)})",
                f"{sum(ok for *_, ok in res)}/{len(res)}",
            ]
        )
    print(machine())
    print(
        table(
            ["callback", "SIGTERM → exit", "exit code", "replayed on resume", "exact"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
