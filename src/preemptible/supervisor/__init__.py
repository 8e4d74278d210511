"""The supervisor behind ``preemptible run``."""

from .._states import RunState
from ._classify import Ending, classify, exit_code_for
from ._config import SupervisorConfig
from ._deadlines import term_timeout
from ._journal import Attempt, Received
from ._policy import RestartPolicy
from ._record import RunRecord, load_record
from ._runid import check_run_id, default_run_id
from ._supervisor import Supervisor

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
