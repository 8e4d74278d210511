"""Hyperparameter sweeps run by ``preemptible agent`` from a queue.

The spec (``_spec``), the samplers (``_sample``) and command building (``_command``) are pure
and import nothing heavy; Optuna is imported only when a ``bayes`` sweep proposes a run.
"""

from __future__ import annotations
