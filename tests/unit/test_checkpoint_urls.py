"""A checkpoint location that is a URL, as the front ends, ``preemptible run`` and the agent
take it: kept as the URL it is (``Path`` would fold ``s3://b/p`` into the relative directory
``s3:/b/p``), ``file://`` as the local path it names, a bad one refused in one line. Nothing
here talks to a bucket: the tests against a real S3 server are in tests/integration."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from preemptible import ConfigError, current_run
from preemptible.cli._main import main
from preemptible.frontend import checkpoint_directory
from preemptible.supervisor import SupervisorConfig
from preemptible.supervisor._record import RunRecord
from preemptible.supervisor._resume import Resumes
from preemptible.supervisor._runid import default_run_id
from preemptible.sweeps.agent._agent import AgentConfig, run_checkpoints
from preemptible.sweeps.agent._holding import newest_step


@pytest.fixture(autouse=True)
def no_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PREEMPTIBLE_CHECKPOINT_DIR", "PREEMPTIBLE_RUN_DIR", "PREEMPTIBLE_RESUME_FROM"):
        monkeypatch.delenv(name, raising=False)


def test_a_front_end_keeps_a_url_as_it_is() -> None:
    assert checkpoint_directory("s3://ckpt/plain/") == "s3://ckpt/plain"
    assert checkpoint_directory("azure://box/run") == "az://box/run"
    assert checkpoint_directory("file:///data/ckpt") == Path("/data/ckpt")
    assert checkpoint_directory("ckpt/") == Path("ckpt")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("s3://ckpt/a/../b", "'..' are not valid"),
        ("ftp://ckpt/a", "unknown scheme 'ftp'"),
        ("s3://ckpt/a?versionId=1", "query string"),
    ],
)
def test_a_bad_url_is_one_line_naming_what_is_valid(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        checkpoint_directory(url)
    assert "\n" not in str(info.value) and str(info.value).startswith("checkpoint location")


def test_the_supervisor_s_url_reaches_the_attempt_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREEMPTIBLE_CHECKPOINT_DIR", "s3://ckpt/runs/exp")
    run = current_run()
    assert (run.checkpoint_url, run.checkpoint_dir) == ("s3://ckpt/runs/exp", None)
    assert checkpoint_directory(None) == "s3://ckpt/runs/exp"
    monkeypatch.setenv("PREEMPTIBLE_CHECKPOINT_DIR", "file:///data/ckpt")
    assert checkpoint_directory(None) == Path("/data/ckpt")


def test_run_and_agent_take_a_url_and_refuse_a_bad_one(tmp_path: Path) -> None:
    config = SupervisorConfig(command=["true"], checkpoint_dir="s3://ckpt/runs/exp/")
    assert config.checkpoint_dir == "s3://ckpt/runs/exp"
    with pytest.raises(ConfigError, match="no bucket"):
        SupervisorConfig(command=["true"], checkpoint_dir="s3:///exp")
    runner = CliRunner()
    done = runner.invoke(main, ["run", "--checkpoint-dir", "gs://ckpt/a/../b", "--", "true"])
    assert done.exit_code == 2 and "'..' are not valid" in done.output, done.output
    done = runner.invoke(main, ["agent", "x", "--checkpoint-dir", "nope://b/p", "--db", "sqlite"])
    assert done.exit_code == 2 and "unknown scheme 'nope'" in done.output, done.output


def test_a_run_id_from_a_url_is_the_same_on_every_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = set()
    for machine in ("one", "two"):
        (tmp_path / machine).mkdir()
        monkeypatch.chdir(tmp_path / machine)
        run_id, why = default_run_id(["python", "train.py"], "s3://ckpt/runs/exp")
        ids.add(run_id)
    assert len(ids) == 1 and run_id.startswith("exp-") and "s3://ckpt/runs/exp" in why
    assert default_run_id(["python", "train.py"], "s3://ckpt/runs/other")[0] not in ids


def test_a_bucket_is_not_looked_into_by_the_supervisor(tmp_path: Path) -> None:
    """The attempt brings the newest checkpoint back itself (on any machine): no
    PREEMPTIBLE_RESUME_FROM, and the log lines name what the record says reached the bucket."""
    resumes = Resumes("s3://ckpt/runs/exp")
    assert resumes.target() is None
    assert resumes.newest_name() == "the newest in s3://ckpt/runs/exp"
    record = RunRecord.from_json(
        {
            "checkpoint_dir": "s3://ckpt/runs/exp",
            "resume_from": str(tmp_path / "staging" / "step-0000000012.ckpt"),
            "resume_step": 12,
            "remote_checkpoint": "s3://ckpt/runs/exp/step-0000000010.ckpt",
        }
    )
    resumes.follow(record)
    assert resumes.directory == "s3://ckpt/runs/exp" and resumes.target() is None
    assert resumes.newest_name() == "s3://ckpt/runs/exp/step-0000000010.ckpt"
    # the queue's checkpoint step is what reached the bucket, else the newest commit
    assert newest_step("s3://ckpt/runs/exp", record) == 10
    assert newest_step("s3://ckpt/runs/exp", RunRecord.from_json({"resume_step": 12})) == 12
    lightning = RunRecord.from_json({"remote_checkpoint": "s3://ckpt/fit/resume.ckpt"})
    assert lightning.remote_step is None


def test_an_agent_keeps_each_run_s_checkpoints_under_its_id() -> None:
    bucket = AgentConfig(sweep_id="s", checkpoint_dir="gs://ckpt/sweeps/s/")
    assert run_checkpoints(bucket, "r-1") == "gs://ckpt/sweeps/s/r-1"
    shared = AgentConfig(sweep_id="s", checkpoint_dir=Path("/shared/ckpt"))
    assert run_checkpoints(shared, "r-1") == Path("/shared/ckpt/r-1")
    assert run_checkpoints(AgentConfig(sweep_id="s"), "r-1") is None
    with pytest.raises(ConfigError, match="no bucket"):
        AgentConfig(sweep_id="s", checkpoint_dir="s3:///x")
