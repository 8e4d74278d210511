"""The stand-in ``train.py`` of README.md's shell examples: a plain loop under the handler.

Uses the supervisor's checkpoint directory (``PreemptionCheckpointHandler(None, state)``) and
prints ``readme-step N`` at each step, like the Python examples' setup.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plain import finish, state, total_steps, train_step

import preemptible

handler = preemptible.PreemptionCheckpointHandler(None, state)
for step in handler.steps(total_steps):
    train_step(step)
finish()
