"""The walk of a SIGTERM through preemptible's own code: which files a reader follows.

A plain loop (``PreemptionCheckpointHandler.steps``) or a Lightning fit
(``GracefulInterruptCallback``) sends itself SIGTERM in the middle of a step; from there to the
stop's ``exit_fn`` every call into a function of preemptible is recorded with
``sys.setprofile``. Reported:

- all of it: the files visited, the calls, the changes of file between successive calls;
- the stop's walk: the files on the call stack (preemptible's frames, outermost first) at each
  step of the stop sequence: the signal recorded, the grace policy's decision, the save, the
  run record's state writes ("stopping", "stopped"), the exit's hold and the exit. A reader
  who opens these files follows the whole sequence; what each step calls into (the saver, the
  record's writer) is a leaf.
- back-and-forth: a call into a file already lower on the stack (a callback, a lambda, a
  mixin calling back into its host), along those stacks.

    .venv/bin/python benchmarks/bench_stop_walk.py [plain|lightning] [--calls]
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import preemptible

ROOT = str(Path(preemptible.__file__).parent) + os.sep
# (file, function) of each step of the stop sequence, in preemptible's source tree
STEPS = {
    ("stop/_latch.py", "_handle"): "signal recorded",
    ("stop/_controller.py", "decide"): "decide",
    ("frontend/_saves.py", "save"): "save",
    ("_run.py", "update_record"): "record",
    ("stop/_latch.py", "hold_for_exit"): "hold",
    ("stop/_termination.py", "exit_process"): "exit",
}
calls: list[tuple[str, str]] = []
walks: dict[str, list[list[str]]] = {}


def _file(frame: FrameType) -> str | None:
    name = frame.f_code.co_filename
    return name[len(ROOT) :] if name.startswith(ROOT) else None


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if event != "call":
        return
    here = _file(frame)
    if here is None:
        return
    calls.append((here, frame.f_code.co_name))
    step = STEPS.get((here, frame.f_code.co_name))
    if step is None or (step == "record" and "state" not in frame.f_locals.get("fields", {})):
        return  # the record's steps are its state's writes (not the newest checkpoint's)
    stack: list[str] = []
    caller = frame if step == "signal recorded" else frame.f_back
    while caller is not None:
        f = _file(caller)
        if f is not None:
            stack.append(f)
        caller = caller.f_back
    walks.setdefault(step, []).append(stack[::-1])


def _report(show_calls: bool) -> None:
    sys.setprofile(None)
    files = [f for f, _ in calls]
    changes = sum(1 for a, b in itertools.pairwise(files) if a != b)
    print(f"all: {len(set(files))} files, {len(calls)} calls, {changes} changes of file")
    walk: list[str] = []
    back = 0
    for stacks in walks.values():
        for stack in stacks:
            collapsed = [f for i, f in enumerate(stack) if i == 0 or stack[i - 1] != f]
            back += len(collapsed) - len(set(collapsed))
            walk += [f for f in collapsed if f not in walk]
    print(f"the stop's walk: {len(walk)} files, {back} back-and-forth")
    for step, stacks in walks.items():
        print(f"  {step:16} {' > '.join(dict.fromkeys(stacks[0]))}")
    if show_calls:
        for f, fn in calls:
            print(f"    {f}:{fn}")


def plain(show_calls: bool) -> None:
    import torch

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handler = preemptible.PreemptionCheckpointHandler(tempfile.mkdtemp(), {"model": model})
    try:
        for step in handler.steps(20):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            if step == 5:
                sys.setprofile(_profile)
                os.kill(os.getpid(), signal.SIGTERM)
    except SystemExit:
        _report(show_calls)


def lightning(show_calls: bool) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from preemptible.lightning import GracefulInterruptCallback

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            if i == 5:
                sys.setprofile(_profile)
                os.kill(os.getpid(), signal.SIGTERM)
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(160, 8), torch.randn(160, 1)), batch_size=8)
    silent = {"enable_progress_bar": False, "enable_model_summary": False}
    callback = GracefulInterruptCallback(tempfile.mkdtemp())
    trainer = pl.Trainer(max_epochs=1, logger=False, callbacks=[callback], **silent)
    try:
        trainer.fit(Model(), data)
    except SystemExit:
        _report(show_calls)


if __name__ == "__main__":
    kind = next((a for a in sys.argv[1:] if not a.startswith("-")), "plain")
    {"plain": plain, "lightning": lightning}[kind]("--calls" in sys.argv)
