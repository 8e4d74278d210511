"""The names the TensorFlow page's loop uses without defining them.

``strategy``: a ``MultiWorkerMirroredStrategy`` of one worker; ``make_model()``: a tiny Keras
model; ``dataset``: batches that repeat; ``TOTAL_STEPS``; ``log_step(step)`` prints
``readme-step N`` (N: the steps trained before it). ``finish()`` saves the final weights.
"""

from __future__ import annotations

import os
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["KERAS_BACKEND"] = "tensorflow"  # tf.keras is Keras 3: its backend, whatever is set

import numpy as _np
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.keras.utils.set_random_seed(0)
_SLEEP = float(os.environ.get("README_STEP_SLEEP", "0"))

strategy = tf.distribute.MultiWorkerMirroredStrategy()
TOTAL_STEPS = 24
_x = _np.random.RandomState(1).randn(32, 4).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices((_x, _x.sum(1, keepdims=True))).batch(8).repeat()


def make_model() -> Any:
    layers = tf.keras.layers
    return tf.keras.Sequential(
        [tf.keras.Input((4,)), layers.Dense(8, activation="relu"), layers.Dense(1)]
    )


def log_step(step: int) -> None:
    print(f"readme-step {step}", flush=True)
    if _SLEEP:
        time.sleep(_SLEEP)


def finish() -> None:
    import torch

    values = [*globals()["model"].variables, *globals()["optimizer"].variables]
    torch.save(
        {f"v{i}": torch.from_numpy(_np.array(v.numpy())) for i, v in enumerate(values)},
        os.environ.get("README_OUT", "final.pt"),
    )
