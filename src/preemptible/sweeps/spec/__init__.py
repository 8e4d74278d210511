"""The sweep spec: W&B's sweep configuration read, checked and modelled; the samplers that turn
it into each run's parameters, the command it runs, and Hyperband's arithmetic. Pure: nothing
heavy is imported (Optuna only when a ``bayes`` sweep proposes a run)."""

from __future__ import annotations

from ._command import build_command
from ._fail import finite_number, kind_of
from ._hyperband import Hyperband, bands, parse_early_terminate, stop_verdict
from ._model import GOALS, Goal, Metric, SweepSpec
from ._sample import Observation, propose
from ._spec import load_spec, parse_spec

__all__ = [
    "GOALS",
    "Goal",
    "Hyperband",
    "Metric",
    "Observation",
    "SweepSpec",
    "bands",
    "build_command",
    "finite_number",
    "kind_of",
    "load_spec",
    "parse_early_terminate",
    "parse_spec",
    "propose",
    "stop_verdict",
]
