"""preemptible's log lines read the same whatever logging a framework set up behind the
program's back (absl's implicit ``logging.basicConfig()`` in a TensorFlow process), and go
through the program's own handlers when it configured some. Each case runs in a fresh
interpreter: pytest's own root handlers would hide the unconfigured cases."""

from __future__ import annotations

import subprocess
import sys

import pytest

STOP_LINES = """
from preemptible._logs import announce, logger
announce("preemptible: received SIGTERM")
logger.warning("preemptible: stopped at step %d", 8)
logger.error("preemptible: tracker failed")
"""


def stderr_of(setup: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", setup + STOP_LINES],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stderr.splitlines()


PLAIN = [
    "preemptible: received SIGTERM",
    "preemptible: stopped at step 8",
    "preemptible: tracker failed",
]


@pytest.mark.parametrize(
    "setup",
    [
        "",  # no logging configured
        "import logging; logging.basicConfig()",  # what absl does the first time it logs
        "import logging; logging.getLogger().addHandler(logging.StreamHandler()); "
        "logging.getLogger().handlers[0].setFormatter(logging.Formatter(logging.BASIC_FORMAT)); "
        "logging.getLogger().setLevel(logging.WARNING)",
    ],
    ids=["nothing", "basicConfig", "the-same-by-hand"],
)
def test_every_line_of_a_stop_has_one_format_under_logging_nobody_configured(setup: str) -> None:
    assert stderr_of(setup) == PLAIN


def test_a_program_s_own_logging_gets_every_line_in_its_format() -> None:
    setup = (
        "import logging\n"
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
    )
    assert stderr_of(setup) == [
        "INFO preemptible: received SIGTERM",
        "WARNING preemptible: stopped at step 8",
        "ERROR preemptible: tracker failed",
    ]


def test_a_program_s_own_format_at_warning_still_gets_the_warnings() -> None:
    setup = "import logging; logging.basicConfig(format='%(levelname)s %(message)s')\n"
    assert stderr_of(setup) == [
        "preemptible: received SIGTERM",  # below its level: written as announce() always did
        "WARNING preemptible: stopped at step 8",
        "ERROR preemptible: tracker failed",
    ]
