"""A tiny Keras 3 fit with ``preemptible.keras.PreemptionCallback`` (the backend from
``KERAS_BACKEND``: torch, tensorflow or jax): dropout, ``shuffle=True``, Adam; arrays, a
``PyDataset`` or a ``tf.data`` input. Run it again with the same arguments and it resumes.

Prints ``batch E B it=N`` after each batch (N: the optimizer's iterations, which a batch
skipped on resume leaves as they are), ``epoch E`` and its logs after each epoch, ``fit done
it=N`` at the end, and writes every model and optimizer variable to ``--out`` (an ``.npz``).
``--slow-write S`` makes each checkpoint write of a step >= ``--slow-write-from`` start a torn
file, print ``writing STEP``, and sleep S s first.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--out", required=True)
p.add_argument("--data", choices=["array", "pydataset", "tfdata"], default="array")
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--samples", type=int, default=48)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--save-every", type=int, default=None)
p.add_argument("--slow-write", type=float, default=0.0)
p.add_argument("--slow-write-from", type=int, default=0)
p.add_argument("--val", action="store_true")
args = p.parse_args()
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

import keras  # noqa: E402

from preemptible.keras import PreemptionCallback  # noqa: E402

sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line

backend = keras.backend.backend()
if backend == "torch":
    import random

    import torch

    torch.set_num_threads(1)
    # keras.utils.set_random_seed(0) without the TensorFlow seed: that import costs each torch
    # process 3 s of CPU (the README's example, run by its test, calls set_random_seed itself)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
elif backend == "jax":
    import random

    # JAX has no global generator: dropout draws from its layer's SeedGenerator, seeded from
    # Python's random when the layer is made (and TensorFlow's import is not paid for)
    random.seed(0)
    np.random.seed(0)
else:
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)

real_savez = np.savez


def slow_savez(fh, **arrays):  # type: ignore[no-untyped-def]
    step = json.loads(arrays["meta"].tobytes())["step"]
    if args.slow_write and step >= args.slow_write_from:
        fh.write(b"PK\x03\x04 a torn checkpoint")
        fh.flush()
        print(f"writing {step}", flush=True)
        time.sleep(args.slow_write)
    real_savez(fh, **arrays)


np.savez = slow_savez

rs = np.random.RandomState(1)
x = rs.randn(args.samples, 4).astype("float32")
y = (x.sum(1, keepdims=True) + 0.1 * rs.randn(args.samples, 1)).astype("float32")
bs = args.batch_size


class Batches(keras.utils.PyDataset):
    def __len__(self) -> int:
        return -(-len(x) // bs)

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        return x[i * bs : (i + 1) * bs], y[i * bs : (i + 1) * bs]


model = keras.Sequential(
    [
        keras.Input((4,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.3),
        keras.layers.Dense(1),
    ]
)
model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])


class Printer(keras.callbacks.Callback):
    """Listed before the preemption callback: it has printed the batch when a stop exits."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0
        self.last = -1

    def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):  # type: ignore[no-untyped-def]
        shown = " ".join(f"{k}={float(v)!r}" for k, v in sorted((logs or {}).items()))
        print(f"epoch {epoch} {shown}", flush=True)

    def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
        it = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        print(f"batch {self.epoch} {batch} it={it}", flush=True)
        if args.step_sleep and it != self.last:
            time.sleep(args.step_sleep)
        self.last = it


callbacks = [Printer(), PreemptionCallback(args.dir, save_every_steps=args.save_every)]
fit_kw = dict(epochs=args.epochs, callbacks=callbacks, verbose=0)
if args.val:
    fit_kw["validation_data"] = (x[:16], y[:16])
if args.data == "array":
    model.fit(x, y, batch_size=bs, shuffle=True, **fit_kw)
elif args.data == "pydataset":
    model.fit(Batches(), shuffle=True, **fit_kw)
else:
    # the same order every epoch (reshuffle_each_iteration=False), as Keras shuffles arrays
    # on TensorFlow: an order that moves on with each pass is not restored
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    ds = ds.shuffle(len(x), seed=1, reshuffle_each_iteration=False).batch(bs)
    model.fit(ds, **fit_kw)
it = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
print(f"fit done it={it}", flush=True)
values = [keras.ops.convert_to_numpy(v) for v in [*model.variables, *model.optimizer.variables]]
with open(args.out, "wb") as fh:
    real_savez(fh, *values)
sys.exit(0)
