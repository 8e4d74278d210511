"""Hyperparameter sweeps run by ``preemptible agent`` from a queue, in five parts, each on the
ones before it: ``spec`` (the spec, its samplers and command: pure, nothing heavy; Optuna only
when a ``bayes`` sweep proposes a run) < ``store`` (the queue, with its SQL) < ``agent`` and
``status`` < ``web`` (``status --serve``). ``tests/unit/test_layers.py`` checks the order.
"""

from __future__ import annotations
