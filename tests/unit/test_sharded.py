"""Sharded checkpoints (torch.distributed.checkpoint) in one process: the layout, an exact
resume, retention and "newest loadable" as for files, and the arguments that do not combine."""

from __future__ import annotations

import random
import shutil
import threading
from pathlib import Path
from typing import Any

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


def test_a_sharded_save_skips_torch_crc32_only_while_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP torch.saves every item; the CRC32 of each record was half of a 1 GB save's time
    and nothing reads it. torch's setting is back as it was for the program's own saves."""
    config = pytest.importorskip("torch.utils.serialization").config
    if not hasattr(config.save, "compute_crc32"):
        pytest.skip("this torch has no save.compute_crc32 setting")
    import torch.distributed.checkpoint as dcp

    during: list[bool] = []
    save = dcp.save

    def recording_save(*args: Any, **kwargs: Any) -> Any:  # DCP's own save, its setting noted
        during.append(config.save.compute_crc32)
        return save(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", recording_save)
    state = make_state(0)
    h = handler(tmp_path, state)
    train(state, h, 1)
    h.save()
    h.close()
    assert during and not any(during)  # the end of the loop commits too
    assert config.save.compute_crc32 is True


@pytest.mark.parametrize("async_save", [False, True])
def test_a_resume_from_a_sharded_checkpoint_is_exact(
    tmp_path: Path, async_save: bool, caplog: pytest.LogCaptureFixture
) -> None:
    random.seed(1)
    np.random.seed(1)
    ref = make_state(0)
    train(ref, handler(tmp_path / "ref", ref), 7)
    ref_draw = (torch.rand(2), random.random(), np.random.rand())

    random.seed(1)
    np.random.seed(1)
    first = make_state(0)
    h = handler(tmp_path, first, save_every_steps=4, async_save=async_save, keep=5)
    with caplog.at_level("INFO", logger="preemptible"):
        train(first, h, 6)
    assert ("in the background (step 4)" in caplog.text) is async_save
    shutil.rmtree(tmp_path / "ckpt" / "step-0000000006.ckpt")  # resume from step 4
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
        ({"sharded": True, "async_policy": "later"}, r"^async_policy='later' is not valid"),
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


def test_the_loop_trains_on_while_a_sharded_checkpoint_is_written_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer of step 3 is held until the loop has started 3 more steps: a synchronous
    save could not return, and the checkpoint still holds the weights of step 3, not later
    ones."""
    import preemptible.distributed._savers as handler_module

    trained_on = threading.Event()
    write_rng = handler_module.write_rank_rng

    def held(directory: Path, rank: int, rng: object) -> None:
        assert trained_on.wait(30), "the loop did not train while the checkpoint was written"
        write_rng(directory, rank, rng)

    monkeypatch.setattr(handler_module, "write_rank_rng", held)
    state = make_state(0)
    h = handler(tmp_path, state, save_every_steps=3, async_save=True, keep=5)
    model = state["model"]
    at_save = None
    for step in h.steps(7):
        if step == 3:
            at_save = {k: v.clone() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
            assert writer(h).in_flight == 3
        if step == 5:  # steps 3, 4 and 5 ran while step 3 was being written
            trained_on.set()
        x = torch.randn(5, 4)
        loss = model(x).square().mean()  # type: ignore[operator]
        state["optimizer"].zero_grad()  # type: ignore[attr-defined]
        loss.backward()
        state["optimizer"].step()  # type: ignore[attr-defined]
    assert at_save is not None
    again = make_state(9)
    shutil.rmtree(tmp_path / "ckpt" / "step-0000000006.ckpt")
    shutil.rmtree(tmp_path / "ckpt" / "step-0000000007.ckpt")
    h2 = handler(tmp_path, again)
    assert h2.resume() == 3
    h2.close()
    for k, v in again["model"].state_dict().items():  # type: ignore[attr-defined]
        assert torch.equal(v, at_save[k]), k


def test_a_sharded_background_save_that_fails_is_reported_and_keeps_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import preemptible.distributed._savers as handler_module

    write_rng = handler_module.write_rank_rng

    def refused(directory: Path, rank: int, rng: object) -> None:
        if "step-0000000004" in directory.name:
            raise OSError(28, "No space left on device")
        write_rng(directory, rank, rng)

    monkeypatch.setattr(handler_module, "write_rank_rng", refused)
    state = make_state(0)
    h = handler(tmp_path, state, save_every_steps=2, async_save=True, keep=5)
    with caplog.at_level("ERROR", logger="preemptible"):
        train(state, h, 5)
    assert "background checkpoint failed" in caplog.text
    assert "No space left on device" in caplog.text
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == [".preemptible.lock", "step-0000000002.ckpt", "step-0000000005.ckpt"], names


@pytest.mark.parametrize("sharded", [False, True])
def test_a_skipped_save_point_waits_an_interval_before_the_next_one(
    tmp_path: Path,
    sharded: bool,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """save_every_seconds with async_policy="skip": while a write is held, a skipped save point
    moves the next one an interval on; it does not come back at every step (a warning and, under
    torch.distributed, an agreement round each)."""
    import time

    import preemptible.distributed._savers as handler_module

    released = threading.Event()
    import preemptible.checkpoint._savers as payload_module

    module = handler_module if sharded else payload_module
    name = "write_rank_rng" if sharded else "write_payload"
    original = getattr(module, name)

    def held(*args: object) -> None:
        assert released.wait(30)
        original(*args)

    monkeypatch.setattr(module, name, held)
    state = make_state(0)
    h = PreemptionCheckpointHandler(
        tmp_path / "ckpt",
        state=state,
        termination_config=TerminationConfig(),
        sharded=sharded,
        async_save=True,
        async_policy="skip",
        save_every_seconds=0.2,
    )
    with caplog.at_level("WARNING", logger="preemptible"):
        start = time.monotonic()
        for _ in h.steps(80):
            time.sleep(0.01)  # 80 steps of >= 10 ms: the write is held for most of them
            if time.monotonic() - start > 0.7:  # by the clock: a loaded machine has slow steps
                released.set()
    released.set()
    skipped = caplog.text.count("skipped: the one of step")
    assert 1 <= skipped <= 5, caplog.text  # ~0.5 s held / 0.2 s interval; not one per step


def writer(h: PreemptionCheckpointHandler) -> Any:
    """The handler's background writer (internal: the kit's state saver holds it)."""
    async_saver = h._session.saver.inner.async_saver  # type: ignore[attr-defined]
    assert async_saver is not None
    return async_saver
