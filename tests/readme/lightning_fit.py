"""The names README.md's Lightning example uses without defining them.

A tiny LightningModule ``model`` (dropout and noise draw from the global RNGs every step), a
shuffled ``train_loader`` and a ``val_loader``, and an active MLflow run in a file store in
the working directory: ``MLflowTracker()`` without arguments needs one. Each training step
prints ``readme-step N``; ``finish()`` saves the final weights.
"""

from __future__ import annotations

import os
import time
from typing import Any

os.environ["MLFLOW_TRACKING_URI"] = "file:./mlruns"  # this run's own store, in its directory
os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # no SQLite set-up (seconds) per run
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the README promises bit-exact resumes on CPU

import lightning.pytorch as _pl
import mlflow
import torch
from torch.utils.data import DataLoader, TensorDataset

_pl.seed_everything(0, verbose=False)
torch.set_num_threads(1)
_SLEEP = float(os.environ.get("README_STEP_SLEEP", "0"))


class _Model(_pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        print(f"readme-step {self.global_step}", flush=True)
        if _SLEEP:
            time.sleep(_SLEEP)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y + 0.01 * torch.randn_like(y))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


_x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
_y = _x.sum(1, keepdim=True)
model = _Model()
train_loader = DataLoader(TensorDataset(_x, _y), batch_size=8, shuffle=True)
val_loader = DataLoader(TensorDataset(_x[:8], _y[:8]), batch_size=8)
mlflow.start_run()


def finish() -> None:
    torch.save(
        {f"model.{k}": v for k, v in model.state_dict().items()},
        os.environ.get("README_OUT", "final.pt"),
    )
