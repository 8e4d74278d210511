"""The names README.md's plain-PyTorch examples use without defining them.

Run by ``run_blocks.py`` in the same namespace as the README block, so ``train_step`` can
read the block's ``handler``. Every step prints ``readme-step N`` as it starts (the test
signals the run at one of them) and draws from the global ``random`` and torch RNGs (noise,
dropout), and the optimizer carries state (Adam): a resume that misses any of them ends
with other weights. The data is a function of the step, as the README recommends.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import torch

import preemptible  # noqa: F401  (README blocks use it without importing it)

torch.manual_seed(0)
random.seed(0)
torch.set_num_threads(1)
_SLEEP = float(os.environ.get("README_STEP_SLEEP", "0"))  # stands in for a longer step

_X = torch.randn(256, 4, generator=torch.Generator().manual_seed(1))
_Y = _X.sum(1, keepdim=True)

model = torch.nn.Sequential(
    torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1)
)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
state: dict[str, Any] = {"model": model, "optimizer": opt}
total_steps = total = 40
epochs, batches_per_epoch = 4, 10
batch = (_X[:8], _Y[:8])  # for handler.run(train_step, batch)
dataset = torch.utils.data.TensorDataset(_X, _Y)  # 32 batches of 8: an epoch ends at step 32


def my_platform_says_we_are_going_down() -> bool:
    return False


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, len(_X), (8,), generator=torch.Generator().manual_seed(step))
    return _X[idx], _Y[idx]


def _train(step: int, data: tuple[torch.Tensor, torch.Tensor], lr: float | None = None) -> None:
    print(f"readme-step {step}", flush=True)
    if lr is not None:
        for group in opt.param_groups:
            group["lr"] = lr
    x, y = data
    noise = 0.01 * torch.randn_like(y) + 0.001 * random.random()
    loss = torch.nn.functional.mse_loss(model(x), y + noise)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if _SLEEP:
        time.sleep(_SLEEP)


def train_step(arg: Any) -> None:
    """``train_step(step)``, or ``train_step(batch)`` under ``handler.run`` (step: handler.step)."""
    if isinstance(arg, int):
        _train(arg, _data(arg))
    else:
        _train(globals()["handler"].step, arg)


def train_batch(epoch: int, batch: int, lr: float | None = None) -> None:
    step = epoch * batches_per_epoch + batch
    _train(step, _data(step), lr)


def validate() -> float:
    model.eval()
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(_X[:32]), _Y[:32])
    model.train()
    return float(loss)


def finish() -> None:
    """After the block: the final weights and the plain values in ``state``, for comparison."""
    out: dict[str, Any] = {f"model.{k}": v for k, v in model.state_dict().items()}
    values = globals().get("state")
    if isinstance(values, dict):
        for key, value in values.items():
            if value is None or isinstance(value, (int, float, str, torch.Tensor)):
                out[f"state.{key}"] = value
    torch.save(out, os.environ.get("README_OUT", "final.pt"))
