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
from preemptible.checkpoint._payload import write_payload
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


def test_staging_reused_across_changing_shapes_never_corrupts_a_checkpoint(
    tmp_path: Path,
) -> None:
    """A buffer kept for one shape must not serve another: each save's file holds exactly the
    values of its save point, even though the loop overwrites them as soon as save() returns."""
    saver = AsyncSaver(CheckpointStore(tmp_path, keep=10))
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = [
        ((1000,), torch.float32),
        ((10, 50), torch.float32),  # fewer elements, same dtype
        ((10, 50), torch.float64),  # same shape, wider dtype
        ((2000,), torch.float32),  # more elements than any buffer so far
        ((1000,), torch.float32),  # back to the first one
    ]
    expected = {}
    for step, (shape, dtype) in enumerate(shapes, start=1):
        w = torch.arange(torch.Size(shape).numel(), dtype=dtype).reshape(shape) + step * 1000
        extra = torch.full((7,), float(step)) if step % 2 else None  # a tensor that comes and goes
        state: dict[str, Any] = {"w": w} if extra is None else {"w": w, "extra": extra}
        expected[step] = {k: v.clone() for k, v in state.items()}
        assert saver.save(step, payload(step, **state), write_payload)
        w.fill_(-1.0)  # the loop changes its tensors right after the save point
        if extra is not None:
            extra.fill_(-1.0)
    saver.close()
    files = {c.step: c.path for c in CheckpointStore(tmp_path).committed()}
    assert sorted(files) == list(expected)
    for step, want in expected.items():
        got = saved(files[step])
        assert set(got) == set(want), step
        for name, value in want.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), (step, name)


def test_buffers_prepared_ahead_serve_the_first_save_and_a_changed_shape_gets_its_own(
    tmp_path: Path,
) -> None:
    saver = AsyncSaver(CheckpointStore(tmp_path, keep=5))
    w, b = torch.full((4096,), 1.0), torch.full((16,), 1.0)
    saver.snapshot.prepare(payload(0, w=w, b=b))
    prestage = saver.snapshot._prestage
    assert prestage is not None
    prestage.thread.join(30)
    ready = {where[-1]: buf.data_ptr() for where, (buf, _) in prestage.buffers.items()}
    assert set(ready) == {"w", "b"}
    b = torch.full((32,), 3.0)  # the loop replaced one tensor by a bigger one since
    assert saver.save(1, payload(1, w=w, b=b), write_payload)
    staged = {where[-1]: buf for where, (buf, _) in saver.snapshot._staging.items()}
    assert staged["w"].data_ptr() == ready["w"]  # allocated ahead, used by the first save
    assert staged["b"].shape == (32,)  # not the prepared (16,) buffer
    w.fill_(2.0)
    b.fill_(4.0)
    done = saver.wait()
    assert done is not None
    got = saved(done[1])
    assert torch.equal(got["w"], torch.full((4096,), 1.0))
    assert torch.equal(got["b"], torch.full((32,), 3.0))
    saver.close()


def test_the_handler_prepares_staging_at_the_first_boundary_and_saves_exact_values(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(32, 32)
    handler = PreemptionCheckpointHandler(
        tmp_path,
        {"model": model},
        termination_config=TerminationConfig(),
        keep=100,
        save_every_steps=4,
        async_save=True,
    )
    writer = handler._session.saver.inner.async_saver
    assert writer is not None
    for step in handler.steps(12):
        if step == 1:  # one boundary passed: the buffers are being allocated in a thread
            assert writer.snapshot.prepared
        with torch.no_grad():
            model.weight.fill_(float(step))
    files = {c.step: c.path for c in CheckpointStore(tmp_path).committed()}
    assert sorted(files) == [4, 8, 12]
    for step, path in files.items():
        weight = torch.load(path, weights_only=True)["state"]["model"]["weight"]
        assert torch.equal(weight, torch.full((32, 32), float(step - 1))), step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device in this environment")
def test_state_on_cpu_and_cuda_is_snapshotted_into_pinned_buffers(tmp_path: Path) -> None:
    saver = AsyncSaver(CheckpointStore(tmp_path, keep=5))
    on_gpu = torch.full((1 << 20,), 1.0, device="cuda")
    on_cpu = torch.full((1000,), 1.0)
    for step in (1, 2):
        on_gpu.mul_(3.0)  # queued on the current stream: the copy must see it
        assert saver.save(step, payload(step, g=on_gpu, c=on_cpu), write_payload)
        on_gpu.fill_(-1.0)
        on_cpu.fill_(-1.0)
        done = saver.wait()
        assert done is not None
        got = saved(done[1])
        assert torch.equal(got["g"], torch.full((1 << 20,), 3.0 if step == 1 else -3.0))
        assert torch.equal(got["c"], torch.full((1000,), 1.0 if step == 1 else -1.0))
        on_cpu.fill_(-1.0)
    pinned = {where[-1]: pin for where, (buf, pin) in saver.snapshot._staging.items()}
    assert pinned == {"g": True, "c": False}
    saver.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device in this environment")
def test_a_synchronous_save_of_cuda_state_goes_through_the_pinned_staging(tmp_path: Path) -> None:
    weight = torch.nn.Parameter(torch.full((1 << 16,), 2.0, device="cuda"))
    handler = PreemptionCheckpointHandler(
        tmp_path, {"model": torch.nn.ParameterList([weight])}, keep=5, async_save=True
    )
    writer = handler._session.saver.inner.async_saver
    assert writer is not None
    path = handler.save()
    assert writer.snapshot.nbytes >= (1 << 16) * 4  # copied into the staging, then written
    with torch.no_grad():
        weight.fill_(-1.0)
    handler.close()
    assert torch.equal(saved(path)["model"]["0"], torch.full((1 << 16,), 2.0))


def test_holds_cuda_never_needs_cuda_for_cpu_state() -> None:
    from preemptible.checkpoint._async import holds_cuda

    assert not holds_cuda({"a": [torch.ones(2), (1, "x")], "b": {"c": None}})
