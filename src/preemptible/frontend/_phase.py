"""Where a front end's boundaries are: ``Phase``."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """Where a boundary is."""

    STEP = "step"
    """After a training step: periodic saves, insurance checkpoints, stops."""
    EVALUATION = "evaluation"
    """After an evaluation batch: a stop is acted on (one process; under torch.distributed the
    ranks are not in step during an evaluation, so the next training step stops them)."""
    END = "end"
    """Training is over: a stop asked for since the last step is acted on (under
    torch.distributed every rank learns whether any rank was asked)."""


# the per-step path compares with these (an enum member read through its class costs as much
# as a function call)
_STEP, _END = Phase.STEP, Phase.END
