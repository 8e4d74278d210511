"""The names the JAX page's loop uses without defining them.

``MLP``: a tiny Flax NNX module with dropout (its key in the ``nnx.Rngs`` it is made with);
``train_batches()``: an epoch's batches, shuffled by NumPy's global generator; ``NUM_EPOCHS``;
``log_step(step)`` prints ``readme-step N`` (N: the steps trained before it). ``finish()``
saves the final model and optimizer arrays (the dropout's key among them).
"""

from __future__ import annotations

import os
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax as _jax
import numpy as _np
from flax import nnx as _nnx

_SLEEP = float(os.environ.get("README_STEP_SLEEP", "0"))
NUM_EPOCHS = 4
_np.random.seed(0)
_x = _np.random.RandomState(1).randn(32, 4).astype("float32")
_y = _x.sum(1, keepdims=True)


class MLP(_nnx.Module):
    def __init__(self, rngs: _nnx.Rngs) -> None:
        self.linear1 = _nnx.Linear(4, 8, rngs=rngs)
        self.dropout = _nnx.Dropout(0.2, rngs=rngs)
        self.linear2 = _nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return self.linear2(self.dropout(_nnx.relu(self.linear1(x))))


def train_batches() -> Any:
    order = _np.random.permutation(len(_x))
    for i in range(0, len(_x), 8):
        yield _x[order[i : i + 8]], _y[order[i : i + 8]]


def log_step(step: int) -> None:
    print(f"readme-step {step}", flush=True)
    if _SLEEP:
        time.sleep(_SLEEP)


def finish() -> None:
    import torch

    state = _nnx.state((globals()["model"], globals()["optimizer"]))
    values = [
        _jax.random.key_data(v) if _jax.dtypes.issubdtype(v.dtype, _jax.dtypes.prng_key) else v
        for v in _jax.tree.leaves(state)
    ]
    torch.save(
        {f"v{i}": torch.from_numpy(_np.array(v)) for i, v in enumerate(values)},
        os.environ.get("README_OUT", "final.pt"),
    )
