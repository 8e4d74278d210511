"""What one ``preemptible doctor`` check reports: a ``Check`` line and its status."""

from __future__ import annotations

from dataclasses import asdict, dataclass

OK, WARN, INFO = "ok", "warn", "info"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)
