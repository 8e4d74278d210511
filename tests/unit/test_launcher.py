"""How ``accelerate launch`` is told by its command line (``stop/_launcher.py``); with real
processes: tests/integration/test_launchers.py."""

from __future__ import annotations

import pytest

from preemptible.stop._launcher import _is_accelerate_launch, elastic_kill_after

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/v/bin/python", "/v/bin/accelerate", "launch", "--cpu", "t.py"], True),
        (["/v/bin/accelerate", "launch", "t.py"], True),
        (["/v/bin/accelerate-launch", "t.py"], True),
        (["python", "-m", "accelerate.commands.launch", "t.py"], True),
        (["python", "-m", "accelerate", "launch", "t.py"], True),
        (["/v/bin/accelerate", "env"], False),
        (["/v/bin/python", "/v/bin/torchrun", "--nproc_per_node", "2", "t.py"], False),
        (["python", "train.py", "accelerate", "launch"], False),
        ([], False),
    ],
)
def test_accelerate_launch_is_told_by_its_command_line(argv: list[str], expected: bool) -> None:
    assert _is_accelerate_launch(argv) is expected


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),  # not a worker of torch's elastic agent
        ({"TORCHELASTIC_RUN_ID": "r"}, 30.0),  # torch's default
        ({"TORCHELASTIC_RUN_ID": "r", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"}, 45.0),
        (
            {
                "TORCHELASTIC_RUN_ID": "r",
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45",
                "PET_SHUTDOWN_TIMEOUT": "12",  # torchrun's option, from the environment
            },
            12.0,
        ),
        ({"TORCHELASTIC_RUN_ID": "r", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, 30.0),
    ],
)
def test_a_torchrun_worker_knows_when_its_agent_kills_it(
    env: dict[str, str], expected: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert elastic_kill_after() == expected
