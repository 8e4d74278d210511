"""What a supervisor is told: ``SupervisorConfig``, checked before anything starts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from .._errors import ConfigError
from ..checkpoint._location import local_or_url
from ._runid import check_run_id

MAX_RESTART_DELAY = 86400.0  # a day: longer is a typo, and select() refuses huge timeouts


@dataclass(kw_only=True)
class SupervisorConfig:
    command: list[str]
    # a local directory, or a bucket's URL (a str: s3://bucket/prefix, gs://, az://)
    checkpoint_dir: Path | str | None = None
    # it came from PREEMPTIBLE_CHECKPOINT_DIR: a parent run's, unused when not nested in it
    checkpoint_dir_from_env: bool = False
    max_failures: int = 0
    max_preemptions: int | None = None  # None: unlimited
    term_timeout: float | None = None  # None: from the platform, else DEFAULT_TERM_TIMEOUT
    forward_signals: bool = True
    # Ctrl+Z (SIGTSTP) stops the job with the supervisor, and fg continues both; an agent's
    # supervisor leaves it to the agent, whose run must go on to stop itself by its lease
    job_control: bool = True
    pid_file: Path | None = None
    home: Path = field(default_factory=lambda: Path(".preemptible"))
    run_id: str | None = None
    restart_delay: float = 1.0
    max_restart_delay: float = 300.0
    heartbeat_interval: float = 10.0
    flap_attempts: int = 5
    min_uptime: float = 10.0
    linger: float = 5.0  # for what the job leaves running: see the module docstring
    extra_env: dict[str, str] = field(default_factory=dict)  # for every attempt (an agent's)
    # an agent's lease file (``lease.json``): the attempt's guardian stops the attempt by it
    # when the agent stops renewing it (``_guard.Fence``)
    lease_file: Path | None = None

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError(
                "no command given; put it after --, e.g. preemptible run -- python train.py"
            )
        for name in ("max_failures", "max_preemptions", "flap_attempts"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ConfigError(f"{name}={value!r} is not valid; use an integer >= 0")
        for name in ("term_timeout", "heartbeat_interval", "min_uptime", "linger"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name}={value!r} is not valid; use seconds >= 0")
        for name in ("restart_delay", "max_restart_delay"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= MAX_RESTART_DELAY):
                raise ConfigError(
                    f"{name}={value!r} is not valid; use seconds from 0 to {MAX_RESTART_DELAY:g}"
                )
        if isinstance(self.checkpoint_dir, str):  # a bad URL: one line, before any start
            self.checkpoint_dir = local_or_url(self.checkpoint_dir)
        if self.run_id is not None:
            check_run_id(self.run_id)
