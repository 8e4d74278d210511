"""The supervisor behind ``preemptible run``."""

from ._classify import Ending, RunState, classify, exit_code_for
from ._record import RunRecord, load_record
from ._supervisor import (
    Attempt,
    Received,
    RestartPolicy,
    Supervisor,
    SupervisorConfig,
    check_run_id,
    default_run_id,
    term_timeout,
)

__all__ = [
    "Attempt",
    "Ending",
    "Received",
    "RestartPolicy",
    "RunRecord",
    "RunState",
    "Supervisor",
    "SupervisorConfig",
    "check_run_id",
    "classify",
    "default_run_id",
    "exit_code_for",
    "load_record",
    "term_timeout",
]
