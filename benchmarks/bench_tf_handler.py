"""preemptible's TensorFlow handler against TensorFlow's own, on the same custom loop.

The loop is TensorFlow's docs loop (a ``MultiWorkerMirroredStrategy``, ``tf.train.Checkpoint``
of a Keras model and optimizer, a ``tf.function`` step, ``handler.run(step, batch)``); only the
handler's import differs: ``preemptible.tensorflow.PreemptionCheckpointHandler`` or
``tf.distribute.experimental.PreemptionCheckpointHandler``. Each step takes ``--step`` seconds
(a sleep inside the function ``run()`` calls, so that a signal lands inside a step). SIGTERM
goes to worker 0 at a random moment of a step, after a few steps; then the same program is
started again and its first step tells where it resumed. Columns:

  signal → gone   SIGTERM sent (by this script) -> every worker's process gone (waitpid)
  exit codes      what the workers exited with (ours: 143; TensorFlow's: 42 off GCP)
  replayed        steps done before the stop and done again after the resume (0: exact)

With ``--workers 1,2`` also two workers (``TF_CONFIG`` on localhost ports).

    .venv/bin/python benchmarks/bench_tf_handler.py [--workers 1,2] [--repeats 3] [--step 0.2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from _common import machine, median, table

CHILD = r"""
import json, os, sys, time
which, ckpt, step_s, units = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
if "RANK_PORTS" in os.environ:
    ports = os.environ["RANK_PORTS"].split(",")
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"localhost:{p}" for p in ports]},
        "task": {"type": "worker", "index": int(os.environ["RANK"])},
    })
os.environ["KERAS_BACKEND"] = "tensorflow"
import numpy as np
import tensorflow as tf

if which == "ours":
    from preemptible.tensorflow import PreemptionCheckpointHandler
else:
    PreemptionCheckpointHandler = tf.distribute.experimental.PreemptionCheckpointHandler
tf.get_logger().setLevel("ERROR")
strategy = tf.distribute.MultiWorkerMirroredStrategy()
tf.keras.utils.set_random_seed(0)
x = np.random.RandomState(1).randn(64, units).astype("float32")
y = x.sum(1, keepdims=True)
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((units,)), tf.keras.layers.Dense(units),
                                 tf.keras.layers.Dense(1)])
    optimizer = tf.keras.optimizers.Adam(1e-3)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    handler = PreemptionCheckpointHandler(strategy.cluster_resolver, checkpoint, ckpt)

@tf.function
def train_step(batch):
    def step_fn(inputs):
        xb, yb = inputs
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return strategy.run(step_fn, args=(batch,))

def step(batch):
    time.sleep(step_s)
    return train_step(batch)

iterator = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat())
for _ in range(handler.total_run_calls):
    next(iterator)
while True:
    handler.run(step, next(iterator))
    print(f"step {int(optimizer.iterations.numpy())}", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(which: str, ckpt: Path, workers: int, step_s: float, units: int) -> list:
    ports = ",".join(str(free_port()) for _ in range(workers))
    procs = []
    for rank in range(workers):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
        if workers > 1:
            env.update(RANK=str(rank), RANK_PORTS=ports, OMP_NUM_THREADS="1")
        args = [sys.executable, "-c", CHILD, which, str(ckpt), str(step_s), str(units)]
        procs.append(
            subprocess.Popen(
                args, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        )
    return procs


def steps_until(proc: subprocess.Popen, n: int) -> list[int]:
    """Read ``step N`` lines until ``n`` of them (or the end of the output)."""
    assert proc.stdout is not None
    seen: list[int] = []
    for line in proc.stdout:
        if line.startswith("step "):
            seen.append(int(line.split()[1]))
            if len(seen) >= n:
                break
    return seen


def rest(proc: subprocess.Popen) -> list[int]:
    assert proc.stdout is not None
    return [int(line.split()[1]) for line in proc.stdout if line.startswith("step ")]


def one(which: str, workers: int, args: argparse.Namespace, rng: random.Random) -> dict:
    with tempfile.TemporaryDirectory() as d:
        ckpt = Path(d) / "ckpt"
        procs = start(which, ckpt, workers, args.step, args.units)
        try:
            done = steps_until(procs[0], 3)
            time.sleep(rng.uniform(0.1, 0.9) * args.step)  # a random moment of a step
            sent = time.monotonic()
            procs[0].send_signal(signal.SIGTERM)
            codes = [p.wait(timeout=300) for p in procs]
            gone = time.monotonic() - sent
            done += rest(procs[0])
        finally:
            for p in procs:
                p.kill()
        again = start(which, ckpt, workers, args.step, args.units)
        try:
            first = steps_until(again[0], 1)
        finally:
            for p in again:
                p.kill()
                p.wait()
        resumed_at = first[0] - 1 if first else 0
    return {"gone": gone, "codes": codes, "replayed": max(done) - resumed_at}


def tf_version() -> str:
    for name in ("tensorflow-cpu", "tensorflow"):
        with contextlib.suppress(PackageNotFoundError):
            return version(name)
    return "?"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", default="1", help="worker counts, e.g. 1,2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step", type=float, default=0.2, help="step time in seconds")
    p.add_argument("--units", type=int, default=256, help="width of the model's hidden layer")
    args = p.parse_args()
    rng = random.Random(0)
    rows = []
    for workers in (int(w) for w in args.workers.split(",")):
        runs: dict[str, list[dict]] = {"preemptible": [], "TensorFlow": []}
        for _ in range(args.repeats):
            for name, which in (("preemptible", "ours"), ("TensorFlow", "tf")):  # interleaved
                runs[name].append(one(which, workers, args, rng))
        for name, got in runs.items():
            codes = sorted({tuple(r["codes"]) for r in got})
            rows.append(
                [
                    name,
                    workers,
                    f"{median([r['gone'] for r in got]):.2f} s",
                    f"{max(r['gone'] for r in got):.2f} s",
                    " ".join(json.dumps(list(c)).replace(" ", "") for c in codes),
                    f"{median([r['replayed'] for r in got]):g}",
                    f"{max(r['replayed'] for r in got)}",
                ]
            )
    print(
        f"machine: {machine()}; TensorFlow {tf_version()} (CPU); step {args.step * 1000:.0f} "
        f"ms; hidden layer {args.units}; SIGTERM to worker 0; median of {args.repeats}\n"
    )
    header = ["handler", "workers", "signal → gone", "max", "exit codes", "replayed", "max"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
