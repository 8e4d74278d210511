"""The one training loop of the demos: the plain demo's job (``_demo``) and a sweep demo's run
(``_train``) differ in their data, their hyperparameters and what they print, not in how a step
is taken.

A batch is a function of the step (a per-epoch permutation drawn from a generator seeded by the
epoch), so a resumed run takes the batches a run never stopped would take; dropout and any
label noise draw from the global RNGs, which preemptible saves and restores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def classifier(hidden: int, lr: float, steps: int) -> tuple[Any, Any, Any]:
    """A two-layer classifier of points in the plane, its AdamW and its cosine schedule."""
    import torch

    model = torch.nn.Sequential(
        torch.nn.Linear(2, hidden),
        torch.nn.Tanh(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(hidden, 2),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    return model, opt, sched


def fit(
    steps: Any,
    parts: tuple[Any, Any, Any],
    points: Any,
    label: Any,
    *,
    batch: int,
    label_noise: float = 0.0,
    started: Callable[[int], None],
    finished: Callable[[int, float], None],
) -> None:
    """Train over ``steps`` (the handler's ``steps(n)``): ``started`` as a step begins,
    ``finished`` with its loss once the optimiser and the schedule have stepped."""
    import torch

    model, opt, sched = parts
    n = len(label)
    per_epoch = n // batch
    for step in steps:
        started(step)
        epoch, offset = divmod(step, per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))
        idx = order[offset * batch : (offset + 1) * batch]
        target = label[idx]
        if label_noise:
            flip = torch.rand(batch) < label_noise  # from the global torch RNG
            target = torch.where(flip, 1 - target, target)
        loss = torch.nn.functional.cross_entropy(model(points[idx]), target)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        sched.step()
        finished(step, loss.item())
