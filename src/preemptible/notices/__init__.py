"""Where a run is, and how that platform announces that it will stop the run.

``detect_platform()`` is cheap and bounded: environment variables, then a few small DMI files
under /sys; it makes no network request. ``default_config()`` turns the platform into the
``TerminationConfig`` that ``PreemptionCheckpointHandler`` uses when it is given none.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .._errors import ConfigError
from .._termination import TerminationConfig

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
    root = Path(os.environ.get("PREEMPTIBLE_DMI_DIR", "/sys/class/dmi/id"))
    try:
        return (root / name).read_text(errors="replace").strip()
    except OSError:
        return ""


def detect() -> Detection:
    forced = os.environ.get("PREEMPTIBLE_PLATFORM")
    if forced:
        if forced not in PLATFORMS:
            raise ConfigError(
                f"PREEMPTIBLE_PLATFORM={forced!r} is not valid; use one of {', '.join(PLATFORMS)}"
            )
        return Detection(forced, "PREEMPTIBLE_PLATFORM")
    for var, platform in OVERRIDES.items():
        if os.environ.get(var):
            return Detection(platform, f"{var} is set")
    if os.environ.get("SLURM_JOB_ID"):
        return Detection("slurm", "SLURM_JOB_ID is set")
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
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
    value = os.environ.get("PREEMPTIBLE_GRACE_PERIOD")
    if not value:
        return None
    try:
        grace = float(value)
    except ValueError:
        raise ConfigError(
            f"PREEMPTIBLE_GRACE_PERIOD={value!r} is not valid; use seconds, e.g. 30"
        ) from None
    if grace < 0:
        raise ConfigError(f"PREEMPTIBLE_GRACE_PERIOD={value!r} is not valid; use seconds >= 0")
    return grace


def sources_for(platform: str) -> list[Source]:
    # imported here: urllib and friends cost ~20 ms that `import preemptible` need not pay
    from ._sources import EC2, GCE, Azure, SlurmTimeLimit, StopFile

    sources: list[Source] = []
    if platform == "gce":
        sources.append(GCE())
    elif platform == "ec2":
        sources.append(EC2())
    elif platform == "azure":
        sources.append(Azure())
    elif platform == "slurm":
        job = os.environ.get("SLURM_JOB_ID")
        if job:
            sources.append(SlurmTimeLimit(job))
    stop_file = os.environ.get("PREEMPTIBLE_STOP_FILE")
    if stop_file:
        sources.append(StopFile(stop_file))
    return sources


def default_config(platform: str | None = None) -> TerminationConfig:
    """The TerminationConfig for ``platform`` (detected when None)."""
    platform = platform or detect_platform()
    window = grace_period_from_env()
    if platform == "kubernetes" and window is None:
        window = KUBERNETES_DEFAULT_GRACE  # terminationGracePeriodSeconds' default
    # The trainer aims to be done EXIT_MARGIN before the platform's SIGKILL: the process still
    # has to exit, and `preemptible run` escalates at window - 2 s.
    grace = None if window is None else max(window - EXIT_MARGIN, 0.0)
    from ._sources import Composite

    sources = sources_for(platform)
    poll = float(os.environ.get("PREEMPTIBLE_POLL_INTERVAL", "1.0"))
    return TerminationConfig(
        termination_watcher_fn=Composite(sources) if sources else None,
        grace_period=grace,
        poll_interval=poll,
    )


__all__ = ["PLATFORMS", "Detection", "default_config", "detect", "detect_platform"]
