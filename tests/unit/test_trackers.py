"""Trackers against a real MLflow store (SQLite, artifacts in a temp dir) and W&B offline."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from preemptible import ConfigError
from preemptible.trackers import LocalTracker, MLflowTracker, Tracker, WandbTracker
from tests.wandb_records import summary


def test_local_tracker_finalizes_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = tmp_path / "resume.ckpt"
    ckpt.write_bytes(b"x")
    t = LocalTracker(tmp_path / "events.jsonl")
    assert isinstance(t, Tracker)
    t.upload_checkpoint(ckpt)
    t.mark_preempting()
    t.finalize("preempted")
    with caplog.at_level(logging.DEBUG, logger="preemptible"):
        t.finalize("finished")  # a finally: block elsewhere must not overwrite the truth
    events = [(e["event"], e.get("status")) for e in t.events()]
    assert events == [("checkpoint", None), ("preempting", None), ("finalize", "preempted")]
    assert "already finalized as preempted" in caplog.text
    with pytest.raises(ConfigError, match="status 'success' is not valid"):
        LocalTracker(tmp_path / "other.jsonl").finalize("success")  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One MLflow store for the session: making one (its schema migrations) takes a second or
    more; each test gets an experiment of its own in it."""
    import mlflow

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    mlflow.MlflowClient(tracking_uri=uri).search_experiments()  # creates the schema now
    return uri


@pytest.fixture
def mlflow_store(mlflow_uri: str, tmp_path: Path, request: pytest.FixtureRequest):
    """The session's store, and a new experiment (named after the test, artifacts under its
    tmp_path) that only this test's runs go to."""
    import uuid

    import mlflow

    mlflow.set_tracking_uri(mlflow_uri)
    name = f"{request.node.name}-{uuid.uuid4().hex[:8]}"
    experiment = mlflow.create_experiment(name, artifact_location=str(tmp_path / "art"))
    yield mlflow_uri, experiment
    while mlflow.active_run() is not None:
        mlflow.end_run()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("status", "stored"),
    [("finished", "FINISHED"), ("failed", "FAILED"), ("preempted", "KILLED"), ("killed", "KILLED")],
)
def test_mlflow_tracker(status: str, stored: str, mlflow_store, tmp_path: Path) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    uri, experiment = mlflow_store
    run = mlflow.start_run(experiment_id=experiment)
    ckpt = tmp_path / "resume.ckpt"
    ckpt.write_bytes(b"weights")
    t = MLflowTracker()
    t.upload_checkpoint(ckpt)
    t.mark_preempting()
    t.finalize(status)  # type: ignore[arg-type]
    t.finalize("finished")
    assert mlflow.active_run() is None
    client = MlflowClient(tracking_uri=uri)
    info = client.get_run(run.info.run_id)
    assert info.info.status == stored
    assert info.data.tags["preemptible.status"] == status
    assert info.data.tags["preemptible.preempting"] == "true"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")]
    assert artifacts == ["checkpoints/resume.ckpt"]


@pytest.mark.timeout(120)
def test_mlflow_tracker_by_run_id(mlflow_store) -> None:
    from mlflow.tracking import MlflowClient

    uri, experiment = mlflow_store
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(experiment).info.run_id
    MLflowTracker(run_id=run_id, tracking_uri=uri).finalize("failed")
    assert client.get_run(run_id).info.status == "FAILED"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("status", "code", "preempting"),
    [("finished", 0, False), ("preempted", 143, True), ("failed", 1, False)],
)
def test_wandb_tracker_offline(
    status: str, code: int, preempting: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="preemptible-test", dir=str(tmp_path))
    ckpt = tmp_path / "resume.ckpt"
    ckpt.write_bytes(b"weights")
    t = WandbTracker(run)
    t.upload_checkpoint(ckpt)
    t.finalize(status)  # type: ignore[arg-type]
    t.finalize("finished")
    found = summary(tmp_path)
    assert found["exit_codes"] == [code]
    assert found["preempting"] is preempting
    assert any(name.startswith("checkpoint-") for name in found["artifacts"]), found
