"""``preemptible agent``: takes runs from the queue, runs each attempt under the supervisor, holds
its lease and judges it for early termination."""

from __future__ import annotations

from ._agent import Agent, AgentConfig

__all__ = ["Agent", "AgentConfig"]
