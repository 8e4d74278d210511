"""Where a run is, and how that platform announces that it will stop the run.

``detect_platform()`` is cheap and bounded: environment variables, then a few small DMI files
under /sys; it makes no network request. ``default_config()`` turns the platform into the
``TerminationConfig`` that ``PreemptionCheckpointHandler`` uses when it is given none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .._env import env_choice, env_float, env_str
from .._run import current_run
from ..stop._termination import TerminationConfig

if TYPE_CHECKING:
    from ._sources import Source

logger = logging.getLogger("preemptible")

PLATFORMS = ("slurm", "gce", "ec2", "azure", "kubernetes", "local")
KUBERNETES_DEFAULT_GRACE = 30.0
EXIT_MARGIN = 5.0
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"

# Setting a platform's endpoint override also selects that platform.
OVERRIDES = {
    "GCE_METADATA_HOST": "gce",
    "AWS_EC2_METADATA_SERVICE_ENDPOINT": "ec2",
    "PREEMPTIBLE_AZURE_METADATA_ENDPOINT": "azure",
}


@dataclass(frozen=True)
class Detection:
    platform: str
    reason: str


def _dmi(name: str) -> str:
    root = Path(env_str("PREEMPTIBLE_DMI_DIR") or "/sys/class/dmi/id")
    try:
        return (root / name).read_text(errors="replace").strip()
    except OSError:
        return ""


def detect() -> Detection:
    forced = env_choice("PREEMPTIBLE_PLATFORM", PLATFORMS)
    if forced:
        return Detection(forced, "PREEMPTIBLE_PLATFORM")
    for var, platform in OVERRIDES.items():
        if env_str(var):  # its value is checked when the platform's source is made
            return Detection(platform, f"{var} is set")
    if env_str("SLURM_JOB_ID"):
        return Detection("slurm", "SLURM_JOB_ID is set")
    if env_str("KUBERNETES_SERVICE_HOST"):
        return Detection("kubernetes", "KUBERNETES_SERVICE_HOST is set")
    product, vendor, bios = _dmi("product_name"), _dmi("sys_vendor"), _dmi("bios_vendor")
    if "Google" in product or bios == "Google":
        return Detection("gce", f"DMI product {product!r}")
    if "Amazon EC2" in vendor or bios.startswith("Amazon EC2"):
        return Detection("ec2", f"DMI vendor {vendor!r}")
    if _dmi("chassis_asset_tag") == AZURE_ASSET_TAG:
        return Detection("azure", "DMI chassis asset tag of Azure")
    return Detection("local", "no cloud, cluster or orchestrator found")


def detect_platform() -> str:
    """``"slurm" | "gce" | "ec2" | "azure" | "kubernetes" | "local"``; see ``detect()``."""
    return detect().platform


def grace_period_from_env() -> float | None:
    """``PREEMPTIBLE_GRACE_PERIOD``: finite seconds >= 0 (nan would make a deadline that is
    never reached), or None when unset."""
    return env_float("PREEMPTIBLE_GRACE_PERIOD")


def poll_interval_from_env() -> float | None:
    """``PREEMPTIBLE_POLL_INTERVAL``: seconds > 0 between two looks at the metadata server."""
    return env_float("PREEMPTIBLE_POLL_INTERVAL", 1.0, strict_min=True)


def check_env() -> None:
    """Every variable a job's notice sources read, checked as they read it, whatever the
    platform (``ConfigError``, one line, for the first bad one): for a supervisor, which
    refuses a bad value before its job starts rather than leave the job to fail at its
    handler with a traceback."""
    from ._http import parse_endpoint
    from ._sources import StopFile, gce_notice_seconds

    env_choice("PREEMPTIBLE_PLATFORM", PLATFORMS)
    grace_period_from_env()
    poll_interval_from_env()
    gce_notice_seconds()
    for var in OVERRIDES:
        value = env_str(var)
        if value:
            parse_endpoint(value, var)
    stop_file = env_str("PREEMPTIBLE_STOP_FILE")
    if stop_file:
        StopFile(stop_file)


def sources_for(platform: str) -> list[Source]:
    # imported here: http.client and ssl cost ~20 ms that `import preemptible` need not pay
    from ._sources import EC2, GCE, Azure, SlurmTimeLimit, StopFile

    sources: list[Source] = []
    if platform == "gce":
        sources.append(GCE())
    elif platform == "ec2":
        sources.append(EC2())
    elif platform == "azure":
        sources.append(Azure())
    elif platform == "slurm":
        job = env_str("SLURM_JOB_ID")
        if job:
            sources.append(SlurmTimeLimit(job))
    stop_file = env_str("PREEMPTIBLE_STOP_FILE")
    if stop_file:
        sources.append(StopFile(stop_file))
    from ._supervised import for_this_attempt

    attempt_dir = current_run().run_dir
    orphaned = for_this_attempt(None if attempt_dir is None else str(attempt_dir))
    if orphaned is not None:
        sources.append(orphaned)  # under a supervisor: stop if it and its guardian are gone
    from ._lease import LEASE_FILE_ENV, LeaseFile

    lease_file = env_str(LEASE_FILE_ENV)  # set by `preemptible agent` for each attempt
    if lease_file:
        sources.append(LeaseFile(lease_file))
    return sources


def default_config(platform: str | None = None) -> TerminationConfig:
    """The TerminationConfig for ``platform`` (detected when None)."""
    platform = platform or detect_platform()
    window = grace_period_from_env()
    poll = poll_interval_from_env()
    if platform == "kubernetes" and window is None:
        window = KUBERNETES_DEFAULT_GRACE  # terminationGracePeriodSeconds' default
    # The trainer aims to be done EXIT_MARGIN before the platform's SIGKILL: the process still
    # has to exit, and `preemptible run` escalates at window - 2 s.
    grace = None if window is None else max(window - EXIT_MARGIN, 0.0)
    from ._sources import Composite

    sources = sources_for(platform)
    return TerminationConfig(
        termination_watcher_fn=Composite(sources) if sources else None,
        grace_period=grace,
        poll_interval=1.0 if poll is None else poll,
    )


__all__ = ["PLATFORMS", "Detection", "default_config", "detect", "detect_platform"]
