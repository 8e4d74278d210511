"""Async snapshots in this process: staging buffers reused between saves, never overwritten
while a background write still reads them; what each checkpoint holds, read back from disk."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from preemptible import PreemptionCheckpointHandler, TerminationConfig
from preemptible.checkpoint._async import AsyncSaver
from preemptible.checkpoint._state import write_payload
from preemptible.checkpoint._store import CheckpointStore
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(60)


def payload(step: int, **state: Any) -> dict[str, Any]:
    return {"format": 1, "step": step, "state": state}


def saved(path: Path) -> dict[str, Any]:
    return dict(torch.load(path, weights_only=True)["state"])


class GatedWrite:
    """A background write that waits for ``gate`` before writing, and says where it is."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()
        self.events: list[str] = []

    def __call__(self, snapshot: Mapping[str, Any], tmp: Path) -> None:
        self.started.set()
        assert self.gate.wait(30), "the test never opened the gate"
        write_payload(snapshot, tmp)
        self.events.append(f"written {snapshot['step']}")


def test_cpu_staging_buffers_are_reused_from_one_save_to_the_next(tmp_path: Path) -> None:
    saver = AsyncSaver(CheckpointStore(tmp_path))
    w = torch.full((1000,), 1.0)
    first = saver.snapshot.copy(payload(1, w=w))
    w.fill_(2.0)
    second = saver.snapshot.copy(payload(2, w=w))
    # one buffer, written over: no page-faulting fresh memory at every save
    assert second["state"]["w"].data_ptr() == first["state"]["w"].data_ptr()
    assert second["state"]["w"].data_ptr() != w.data_ptr()
    assert torch.equal(second["state"]["w"], w)
    assert saver.snapshot.nbytes == w.numel() * w.element_size()


def test_a_tensor_at_two_places_is_copied_once_and_stale_buffers_are_dropped(
    tmp_path: Path,
) -> None:
    saver = AsyncSaver(CheckpointStore(tmp_path))
    model = torch.nn.Sequential(torch.nn.Embedding(64, 4), torch.nn.Linear(4, 64, bias=False))
    model[1].weight = model[0].weight  # tied: state_dict() has two views of one storage
    out = saver.snapshot.copy(payload(1, model=model.state_dict()))
    assert out["state"]["model"]["0.weight"] is out["state"]["model"]["1.weight"]
    assert saver.snapshot.nbytes == 64 * 4 * 4
    saver.snapshot.copy(payload(2, other=torch.ones(10, dtype=torch.float64)))
    assert saver.snapshot.nbytes == 10 * 8  # the tied one is gone from the payload
    saver.close()
    assert saver.snapshot.nbytes == 0


def test_skip_policy_never_overwrites_the_snapshot_being_written(tmp_path: Path) -> None:
    saver = AsyncSaver(CheckpointStore(tmp_path, keep=5), policy="skip")
    write = GatedWrite()
    w = torch.full((4096,), 1.0)
    assert saver.save(1, payload(1, w=w), write)
    assert write.started.wait(30)
    w.fill_(2.0)
    # the handler's order (copy, then submit): the copy goes to fresh memory, then is skipped
    fresh = saver.snapshot.copy(payload(2, w=w))
    assert not saver.submit(2, lambda tmp: write_payload(fresh, tmp))
    assert not saver.save(3, payload(3, w=w), write)
    assert torch.equal(fresh["state"]["w"], w)
    write.gate.set()
    done = saver.wait()
    assert done is not None and done[0] == 1
    assert torch.equal(saved(done[1])["w"], torch.full((4096,), 1.0))


def test_wait_policy_copies_only_after_the_write_in_flight_is_committed(tmp_path: Path) -> None:
    saver = AsyncSaver(CheckpointStore(tmp_path, keep=5))
    write = GatedWrite()
    w = torch.full((4096,), 1.0)
    assert saver.save(1, payload(1, w=w), write)
    assert write.started.wait(30)
    w.fill_(2.0)
    free = saver.snapshot._free
    assert free is not None

    def room() -> bool:  # the copy is about to choose its buffers: let the write go now
        write.gate.set()
        answer = free()
        write.events.append("copy")
        return answer

    saver.snapshot._free = room
    second = saver.snapshot.copy(payload(2, w=w))
    assert write.events == ["written 1", "copy"]
    assert saver.submit(2, lambda tmp: write_payload(second, tmp))
    saver.wait()
    files = {c.step: c.path for c in CheckpointStore(tmp_path).committed()}
    assert torch.equal(saved(files[1])["w"], torch.full((4096,), 1.0))
    assert torch.equal(saved(files[2])["w"], torch.full((4096,), 2.0))


def test_every_background_checkpoint_holds_its_own_step(tmp_path: Path) -> None:
    """Through the handler: the loop changes the state right after each save point while the
    write of the previous one may be in flight; each file must hold the state of its step."""
    model = torch.nn.Linear(64, 64)
    handler = PreemptionCheckpointHandler(
        tmp_path,
        {"model": model},
        termination_config=TerminationConfig(),
        keep=100,
        save_every_steps=1,
        async_save=True,
    )
    writer = handler._session.saver.inner.async_saver  # the kit's background writer
    assert writer is not None
    staged = []
    for step in handler.steps(12):
        with torch.no_grad():
            model.weight.fill_(float(step))
        staged.append(writer.snapshot.nbytes)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert staged[-1] >= nbytes  # the model (and the RNG state) in staging buffers
    files = {c.step: c.path for c in CheckpointStore(tmp_path).committed()}
    assert sorted(files) == list(range(1, 13))
    for step, path in files.items():
        weight = torch.load(path, weights_only=True)["state"]["model"]["weight"]
        assert torch.equal(weight, torch.full((64, 64), float(step - 1))), step


def test_close_waits_and_frees_the_staging(tmp_path: Path) -> None:
    saver = AsyncSaver(CheckpointStore(tmp_path))
    write = GatedWrite()
    assert saver.save(1, payload(1, w=torch.ones(100)), write)
    wait_for(write.started.is_set, 30, "the write to start")
    write.gate.set()
    saver.close()
    assert saver.in_flight is None and saver.snapshot.nbytes == 0
    assert [c.step for c in CheckpointStore(tmp_path).committed()] == [1]
