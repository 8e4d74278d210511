"""A custom TensorFlow loop written after TensorFlow's ``PreemptionCheckpointHandler`` docs (a
``tf.function`` step, ``tf.train.Checkpoint`` of a Keras model and optimizer, an iterator
over a ``tf.data`` dataset, epochs and steps from ``total_run_calls``), ported by the one
import. Its step draws noise from TensorFlow's global generator, and its dropout masks from
the layer's Keras ``SeedGenerator``. Run it again with the same
arguments and it resumes.

Several workers: ``RANK``, ``WORLD_SIZE`` and ``RANK_PORTS`` (one localhost port per worker, as
tests/support/reference.py starts ranks) become the ``TF_CONFIG`` of worker ``RANK``.

Prints ``step N loss=L`` after each step (N: the optimizer's iterations), ``done it=N`` at the end,
and writes the model's and optimizer's variables to ``--out`` (the chief; worker ``i`` to
``--out`` with ``-i`` before the suffix).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--exit-42", action="store_true")
p.add_argument("--save-every-steps", type=int)
args = p.parse_args()
RANK = 0
if "RANK_PORTS" in os.environ:  # TF_CONFIG on localhost, and no torch.distributed variables
    RANK = int(os.environ.pop("RANK"))
    ports = os.environ.pop("RANK_PORTS").split(",")
    for name in ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"localhost:{port}" for port in ports]},
            "task": {"type": "worker", "index": RANK},
        }
    )
os.environ["KERAS_BACKEND"] = "tensorflow"  # tf.keras is Keras 3: its backend, whatever is set

import tensorflow as tf  # noqa: E402

from preemptible.tensorflow import PreemptionCheckpointHandler  # noqa: E402  (the one change)

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
strategy = tf.distribute.MultiWorkerMirroredStrategy()  # first: before anything starts TF
tf.keras.utils.set_random_seed(0)  # Keras 3 initializers: its seed, not tf.random.set_seed
tf.random.set_global_generator(tf.random.Generator.from_seed(0))

STEPS_PER_EPOCH = 6
rs = np.random.RandomState(1)
x = rs.randn(48, 4).astype("float32")
y = x.sum(1, keepdims=True).astype("float32")

with strategy.scope():
    model = tf.keras.Sequential(
        [
            tf.keras.Input((4,)),
            tf.keras.layers.Dense(8, activation="relu"),
            tf.keras.layers.Dropout(0.25),  # its masks come from a SeedGenerator's state
            tf.keras.layers.Dense(1),
        ]
    )
    optimizer = tf.keras.optimizers.Adam(1e-2)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    config = None
    if args.exit_42:
        config = tf.distribute.experimental.TerminationConfig(exit_fn=lambda: sys.exit(42))
    handler = PreemptionCheckpointHandler(
        strategy.cluster_resolver,
        checkpoint,
        checkpoint_dir=args.dir,
        termination_config=config,
        save_every_steps=args.save_every_steps,
    )


@tf.function
def train_step(batch):
    def step_fn(inputs):
        xb, yb = inputs
        noise = tf.random.get_global_generator().normal(tf.shape(yb), stddev=0.1)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - (yb + noise)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return strategy.run(step_fn, args=(batch,))


dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
iterator = iter(dataset)
for _ in range(handler.total_run_calls):  # the batches done: the iterator's position
    next(iterator)
for epoch in range(handler.total_run_calls // STEPS_PER_EPOCH, args.epochs):
    for step in range(handler.total_run_calls % STEPS_PER_EPOCH, STEPS_PER_EPOCH):
        loss = handler.run(train_step, next(iterator))
        it = int(optimizer.iterations.numpy())
        print(f"step {it} loss={float(loss)!r} epoch={epoch} in_epoch={step}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
handler.close()  # the last step committed: a stop after the loop retrains nothing
print(f"done it={int(optimizer.iterations.numpy())}", flush=True)
out = args.out if RANK == 0 else f"-{RANK}".join(os.path.splitext(args.out))
with open(out, "wb") as fh:
    np.savez(fh, *[v.numpy() for v in [*model.variables, *optimizer.variables]])
