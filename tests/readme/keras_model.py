"""The names README.md's Keras example uses without defining them.

``make_model()``: a tiny compiled Keras model (dropout) whose every training batch prints
``readme-step N`` (N: the batches trained before it); ``x``, ``y``: its data. The torch backend
unless ``KERAS_BACKEND`` says otherwise. ``finish()`` saves the final weights.
"""

from __future__ import annotations

import os
import time
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras as _keras
import numpy as _np
import torch as _torch

_torch.set_num_threads(1)
_SLEEP = float(os.environ.get("README_STEP_SLEEP", "0"))


class _Printing(_keras.Sequential):
    def train_step(self, data: Any) -> Any:  # eager on the torch backend: runs every batch
        step = int(_keras.ops.convert_to_numpy(self.optimizer.iterations))
        print(f"readme-step {step}", flush=True)
        if _SLEEP:
            time.sleep(_SLEEP)
        return super().train_step(data)


def make_model() -> Any:
    model = _Printing(
        [
            _keras.Input((4,)),
            _keras.layers.Dense(8, activation="relu"),
            _keras.layers.Dropout(0.2),
            _keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=_keras.optimizers.Adam(1e-2), loss="mse")
    return model


x = _np.random.RandomState(1).randn(32, 4).astype("float32")
y = x.sum(1, keepdims=True)


def finish() -> None:
    model = globals()["model"]
    values = [*model.variables, *model.optimizer.variables]
    _torch.save(
        {
            f"v{i}": _torch.from_numpy(_keras.ops.convert_to_numpy(v).copy())
            for i, v in enumerate(values)
        },
        os.environ.get("README_OUT", "final.pt"),
    )
