"""Sharded checkpoints (torch.distributed.checkpoint) in one process: the layout, an exact
resume, retention and "newest loadable" as for files, and the arguments that do not combine."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from preemptible import ConfigError, PreemptionCheckpointHandler, TerminationConfig


def make_state(seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return {"model": model, "optimizer": opt, "scheduler": sched, "best": 10.0}


def train(state: dict[str, object], handler: PreemptionCheckpointHandler, total: int) -> None:
    model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    for _ in handler.steps(total):
        x = torch.randn(5, 4) + random.random() + float(np.random.rand())
        loss = model(x).square().mean()  # type: ignore[operator]
        opt.zero_grad()  # type: ignore[attr-defined]
        loss.backward()
        opt.step()  # type: ignore[attr-defined]
        sched.step()  # type: ignore[attr-defined]
        state["best"] = min(float(state["best"]), loss.item())  # type: ignore[arg-type]


def handler(tmp_path: Path, state: dict[str, object], **kw: object) -> PreemptionCheckpointHandler:
    return PreemptionCheckpointHandler(
        tmp_path / "ckpt",
        state=state,
        termination_config=TerminationConfig(),
        sharded=True,
        **kw,  # type: ignore[arg-type]
    )


def test_a_sharded_checkpoint_is_a_directory_committed_whole(tmp_path: Path) -> None:
    state = make_state(0)
    h = handler(tmp_path, state, save_every_steps=2, keep=2)
    train(state, h, 6)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith("."))
    assert names == ["step-0000000004.ckpt", "step-0000000006.ckpt"]  # keep=2 pruned step 2
    inside = sorted(p.name for p in (tmp_path / "ckpt" / names[-1]).iterdir())
    assert inside == [".metadata", "__0_0.distcp", "preemptible.pt", "rng-0.pt"]


def test_a_resume_from_a_sharded_checkpoint_is_exact(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(1)
    ref = make_state(0)
    train(ref, handler(tmp_path / "ref", ref), 7)
    ref_draw = (torch.rand(2), random.random(), np.random.rand())

    random.seed(1)
    np.random.seed(1)
    first = make_state(0)
    train(first, handler(tmp_path, first, save_every_steps=4), 4)
    torch.manual_seed(99)  # the resumed process starts with other streams and other weights
    random.seed(99)
    np.random.seed(99)
    resumed = make_state(5)
    h = handler(tmp_path, resumed)
    assert h.resume() == 4
    train(resumed, h, 7)
    for a, b in zip(ref["model"].parameters(), resumed["model"].parameters(), strict=True):  # type: ignore[attr-defined]
        assert torch.equal(a, b)
    assert resumed["best"] == ref["best"]
    assert resumed["scheduler"].state_dict() == ref["scheduler"].state_dict()  # type: ignore[attr-defined]
    draw = (torch.rand(2), random.random(), np.random.rand())
    assert torch.equal(draw[0], ref_draw[0]) and draw[1:] == ref_draw[1:]


def test_an_incomplete_newest_directory_is_skipped_for_the_previous_one(tmp_path: Path) -> None:
    state = make_state(0)
    train(state, handler(tmp_path, state, save_every_steps=2), 4)
    newest = tmp_path / "ckpt" / "step-0000000004.ckpt"
    (newest / ".metadata").unlink()  # as if a rank's part never arrived
    again = make_state(0)
    h = handler(tmp_path, again)
    assert h.resume() == 2
    h.close()
    assert (tmp_path / "ckpt" / "step-0000000004.ckpt.unloadable").is_dir()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sharded": "yes"}, r"^sharded='yes' is not valid; use True or False$"),
        ({"sharded": True, "async_save": True}, r"^async_save is not available for sharded"),
    ],
)
def test_arguments_that_do_not_combine_are_one_clear_line(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        PreemptionCheckpointHandler(
            tmp_path,
            state=make_state(0),
            termination_config=TerminationConfig(),
            **kwargs,  # type: ignore[arg-type]
        )


def test_sharded_with_a_save_fn_is_refused(tmp_path: Path) -> None:
    config = TerminationConfig(save_fn=lambda p: p.write_text("x"))
    with pytest.raises(ConfigError, match=r"^sharded checkpoints are written by preemptible"):
        PreemptionCheckpointHandler(tmp_path, termination_config=config, sharded=True)


def test_an_optimizer_without_exactly_one_module_is_refused_at_the_first_save(
    tmp_path: Path,
) -> None:
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    h = handler(tmp_path, {"a": a, "b": b, "optimizer": opt})
    with pytest.raises(ConfigError, match=r"exactly one module in state \(found 2: a, b\)"):
        h.save(1)
    h.close()
