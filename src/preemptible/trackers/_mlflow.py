from __future__ import annotations

from pathlib import Path
from typing import Any

from .._errors import ConfigError
from ._base import BaseTracker, Status

# MLflow knows three terminal statuses; a preemption is closest to KILLED (stopped from
# outside, not by a bug) and gets a tag that says what it really was.
_MLFLOW_STATUS = {
    "finished": "FINISHED",
    "failed": "FAILED",
    "preempted": "KILLED",
    "killed": "KILLED",
}


class MLflowTracker(BaseTracker):
    """An MLflow run: the active run, or ``run_id`` in ``tracking_uri`` (or MLflow's default).

    Checkpoints go to the run's artifacts under ``checkpoints/``; finalize ends the run with
    FINISHED, FAILED or KILLED and tags it ``preemptible.status`` with the exact status.
    """

    def __init__(self, run_id: str | None = None, tracking_uri: str | None = None) -> None:
        super().__init__()
        import mlflow
        from mlflow.tracking import MlflowClient

        self._mlflow = mlflow
        self.client: Any = MlflowClient(tracking_uri=tracking_uri)
        if run_id is None:
            active = mlflow.active_run()
            if active is None:
                raise ConfigError("no active MLflow run; start one or pass run_id=")
            run_id = active.info.run_id
        self.run_id: str = run_id

    def _upload(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path="checkpoints")

    def _mark_preempting(self) -> None:
        self.client.set_tag(self.run_id, "preemptible.preempting", "true")

    def _finalize(self, status: Status) -> None:
        self.client.set_tag(self.run_id, "preemptible.status", status)
        mlflow_status = _MLFLOW_STATUS[status]
        active = self._mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            self._mlflow.end_run(status=mlflow_status)  # also clears the fluent run stack
        else:
            self.client.set_terminated(self.run_id, status=mlflow_status)
