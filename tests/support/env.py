"""The environment that tells preemptible where it runs, cleared for a test.

A test suite started inside a SLURM job, on a cloud VM or with a ``PREEMPTIBLE_*`` setting
exported would otherwise hand that to every child process and to the code under test:
``CLEAN`` blanks each of those variables (empty means "not given" to preemptible), for child
processes; the ``clean_platform_env`` fixture removes them from the test process itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

PLATFORM_VARS = (
    # where it runs
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "KUBERNETES_SERVICE_HOST",
    "PREEMPTIBLE_PLATFORM",
    "GCE_METADATA_HOST",
    "AWS_EC2_METADATA_SERVICE_ENDPOINT",
    "PREEMPTIBLE_AZURE_METADATA_ENDPOINT",
    # how it stops there
    "PREEMPTIBLE_GRACE_PERIOD",
    "PREEMPTIBLE_TERM_TIMEOUT",
    "PREEMPTIBLE_REQUEUE",
    "PREEMPTIBLE_STOP_FILE",
    "PREEMPTIBLE_EXIT_SECONDS",
    "PREEMPTIBLE_POLL_INTERVAL",
    "PREEMPTIBLE_GCE_NOTICE_SECONDS",
    "PREEMPTIBLE_CONTAINMENT",
    # what a supervisor tells the process it runs
    "PREEMPTIBLE_RUN_DIR",
    "PREEMPTIBLE_KILL_AFTER",
)

# for a child's environment, over os.environ: {**os.environ, **CLEAN, ...}, or Child(env=CLEAN)
CLEAN: dict[str, str] = dict.fromkeys(PLATFORM_VARS, "")


def clean(**overrides: str) -> dict[str, str]:
    """A fresh copy of ``CLEAN`` with ``overrides`` on top."""
    return {**CLEAN, **overrides}


@pytest.fixture
def clean_platform_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The test process as on a plain machine: no platform variable, no DMI vendor strings."""
    for var in PLATFORM_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PREEMPTIBLE_DMI_DIR", str(tmp_path / "dmi"))
