"""Experiment trackers, told the truth once: upload the checkpoint, mark preempting, finalize.

``Tracker`` is the protocol the handler and the Lightning callback use. Every adapter
finalizes at most once — a second ``finalize`` is ignored with a debug line — because the most
common tracker bug around preemption is a second finalization (a ``finally:`` block that marks
an interrupted run "success" after the interrupt path marked it "failed").

    Tracker (protocol)
    ├── LocalTracker   JSON lines in a file, for runs with no tracking server
    ├── MLflowTracker  MLflow (pip install 'preemptible[mlflow]')
    └── WandbTracker   Weights & Biases (pip install 'preemptible[wandb]')
"""

from typing import TYPE_CHECKING

from ._base import STATUSES, BaseTracker, Status, Tracker, TrackerGroup
from ._local import LocalTracker

if TYPE_CHECKING:  # imported for real only when asked for (below)
    from ._mlflow import MLflowTracker
    from ._wandb import WandbTracker

__all__ = [
    "STATUSES",
    "BaseTracker",
    "LocalTracker",
    "MLflowTracker",
    "Status",
    "Tracker",
    "TrackerGroup",
    "WandbTracker",
]


def __getattr__(name: str) -> object:
    # MLflow and W&B are imported only when their adapter is asked for
    if name == "MLflowTracker":
        from ._mlflow import MLflowTracker

        return MLflowTracker
    if name == "WandbTracker":
        from ._wandb import WandbTracker

        return WandbTracker
    raise AttributeError(name)
