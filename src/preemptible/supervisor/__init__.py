"""The supervisor behind ``preemptible run``."""

from ._classify import Ending, RunState, classify, exit_code_for
from ._supervisor import Attempt, Supervisor, SupervisorConfig, check_run_id, term_timeout

__all__ = [
    "Attempt",
    "Ending",
    "RunState",
    "Supervisor",
    "SupervisorConfig",
    "check_run_id",
    "classify",
    "exit_code_for",
    "term_timeout",
]
