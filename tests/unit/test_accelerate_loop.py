"""``preemptible.accelerate.PreemptibleLoop`` in the test process, one process, a real
``Accelerator`` on the CPU: bad arguments, the committed ``checkpoint-N`` of a finished run
(``accelerator.save_state``'s files and the position), and a rerun that trains nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("accelerate")

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from preemptible.accelerate import PreemptibleLoop
from preemptible.frontend import ConfigError


def prepared() -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, DataLoader]:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    x = torch.randn(12, 3)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    return accelerator, model, opt, loader


def train(loop: PreemptibleLoop, model, opt, loader, epochs: int) -> int:  # type: ignore[no-untyped-def]
    trained = 0
    for _epoch in loop.epochs(epochs):
        for x, y in loop.batches(loader):
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            trained += 1
    return trained


def test_bad_arguments_name_what_is_valid(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="accelerator=object is not valid"):
        PreemptibleLoop(object(), tmp_path)
    accelerator, *_ = prepared()
    with pytest.raises(ConfigError, match="keep=0 is not valid"):
        PreemptibleLoop(accelerator, tmp_path, keep=0)
    loop = PreemptibleLoop(accelerator, tmp_path)
    try:
        with pytest.raises(ConfigError, match="total=-1 is not valid"):
            loop.epochs(-1)
    finally:
        loop.session.close()


def test_a_finished_run_is_committed_and_a_rerun_trains_nothing(tmp_path: Path) -> None:
    accelerator, model, opt, loader = prepared()
    loop = PreemptibleLoop(accelerator, tmp_path)
    assert train(loop, model, opt, loader, 2) == 6
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-6"]
    saved = tmp_path / "checkpoint-6"
    assert (saved / "optimizer.bin").is_file() and (saved / "random_states_0.pkl").is_file()
    position = torch.load(saved / "preemptible_position_0.pt", weights_only=True)
    assert (position["step"], position["epoch"], position["batch"]) == (6, 2, 0)
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    again = PreemptibleLoop(accelerator, tmp_path)
    assert again.resume_path == saved and (again.step, again.epoch) == (6, 2)
    assert train(again, model, opt, loader, 2) == 0
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_the_optimizers_torch_save_skips_the_crc32_nothing_reads(tmp_path: Path) -> None:
    """accelerate writes the optimizer with torch.save: inside the loop's save it is written
    without the CRC32 of each record (the CPU cost of serializing), as a payload is; it loads
    the same, and torch's setting is back for the program's own saves."""
    config = pytest.importorskip("torch.utils.serialization").config
    if not hasattr(config.save, "compute_crc32"):
        pytest.skip("this torch has no save.compute_crc32 setting")
    import zipfile

    accelerator, model, opt, loader = prepared()
    opt.param_groups[0]["momentum"] = 0.9  # a state of tensors: its momentum buffers
    loop = PreemptibleLoop(accelerator, tmp_path)
    train(loop, model, opt, loader, 1)
    optimizer = tmp_path / "checkpoint-3" / "optimizer.bin"
    with zipfile.ZipFile(optimizer) as archive:
        records = [i for i in archive.infolist() if "/data/" in i.filename]
        assert records and all(i.CRC == 0 for i in records)
    loaded = torch.load(optimizer, weights_only=True)
    buffers = [v["momentum_buffer"] for v in loaded["state"].values()]
    assert buffers and all(torch.isfinite(b).all() for b in buffers)
    assert config.save.compute_crc32 is True
