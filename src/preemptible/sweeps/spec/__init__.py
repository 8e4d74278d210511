"""The sweep spec: W&B's sweep configuration read, checked and modelled; the samplers that turn
it into each run's parameters, the command it runs, and Hyperband's arithmetic. Pure: nothing
heavy is imported (Optuna only when a ``bayes`` sweep proposes a run)."""

from __future__ import annotations
