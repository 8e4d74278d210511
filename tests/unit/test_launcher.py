"""How ``accelerate launch`` is told by its command line (``stop/_launcher.py``); with real
processes: tests/integration/test_launchers.py."""

from __future__ import annotations

import pytest

from preemptible.stop._launcher import _is_accelerate_launch

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
