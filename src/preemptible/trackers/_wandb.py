from __future__ import annotations

from pathlib import Path
from typing import Any

from .._errors import ConfigError
from ._base import BaseTracker, Status

# W&B derives the run state from the exit code (0 = finished, else failed) and from
# mark_preempting(), which makes the server treat the ending as a preemption.
_EXIT_CODE = {"finished": 0, "failed": 1, "preempted": 143, "killed": 130}


class WandbTracker(BaseTracker):
    """A W&B run (the current ``wandb.run`` by default). Checkpoints become a ``model``
    artifact; finalize calls ``run.finish(exit_code=...)`` once."""

    def __init__(self, run: Any | None = None, artifact_name: str | None = None) -> None:
        super().__init__()
        import wandb

        self._wandb = wandb
        found = run if run is not None else wandb.run
        if found is None:
            raise ConfigError("no active W&B run; call wandb.init() or pass run=")
        self.run: Any = found
        self.artifact_name = artifact_name or f"checkpoint-{self.run.id}"
        self._preempting = False

    def _upload(self, path: Path) -> None:
        artifact = self._wandb.Artifact(self.artifact_name, type="model")
        if path.is_dir():
            artifact.add_dir(str(path))
        else:
            artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def _mark_preempting(self) -> None:
        if not self._preempting:
            self._preempting = True
            self.run.mark_preempting()

    def _finalize(self, status: Status) -> None:
        if status == "preempted":
            self._mark_preempting()
        self.run.finish(exit_code=_EXIT_CODE[status])
