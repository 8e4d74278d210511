"""The state payload: plain values beside stateful objects, key mismatches, checkpoints that
do not fit the model. Real checkpoints written by the handler and read back."""

from __future__ import annotations

import logging
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from preemptible import CheckpointLoadError, ConfigError, PreemptionCheckpointHandler
from preemptible.checkpoint._payload import apply_payload, build_payload, check_state, read_payload
from preemptible.checkpoint._store import LOCK_NAME


def checkpoints(directory: Path) -> list[str]:
    """Everything in the directory but the writer's lock file."""
    return sorted(p.name for p in directory.iterdir() if p.name != LOCK_NAME)


def save_once(tmp_path: Path, state: dict[str, object], step: int = 0) -> Path:
    h = PreemptionCheckpointHandler(tmp_path, state)
    for _ in h.steps(step):
        pass
    path = h.save()
    h.close()
    return path


def resume(tmp_path: Path, state: dict[str, object]) -> int:
    h = PreemptionCheckpointHandler(tmp_path, state)
    try:
        return h.resume()
    finally:
        h.close()


# -- plain values --------------------------------------------------------------------------


def test_plain_values_are_saved_at_save_time_and_restored_into_the_same_mapping(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    state: dict[str, object] = {"model": torch.nn.Linear(2, 2), "best": float("inf")}
    h = PreemptionCheckpointHandler(tmp_path, state, save_every_steps=3)
    for step in h.steps(3):
        # the loop rebinds values in the mapping (and adds new ones) after the handler is made
        state["best"] = 0.25 + step
        state["epoch"] = step
        state["hidden"] = torch.full((2, 3), float(step))
        state["history"] = [0.5, 1.5, None]
        state["pair"] = (1, "a", True)
        state["nested"] = {"a": [(1, 2.0)], "t": (torch.ones(2),), "empty": {}}
        state["name"] = "run-7"
    expected = {k: v for k, v in state.items() if k != "model"}

    fresh: dict[str, object] = {
        "model": torch.nn.Linear(2, 2),
        "best": float("inf"),
        "epoch": 0,
        "hidden": torch.zeros(2, 3),
        "history": [],
        "pair": (0, "", False),
        "nested": {},
        "name": "",
    }
    same = fresh
    assert resume(tmp_path, fresh) == 3
    assert fresh is same
    assert fresh["best"] == 2.25 and type(fresh["best"]) is float
    assert fresh["epoch"] == 2 and type(fresh["epoch"]) is int
    assert fresh["pair"] == (1, "a", True) and type(fresh["pair"]) is tuple
    assert type(fresh["pair"][2]) is bool  # type: ignore[index]
    assert fresh["history"] == [0.5, 1.5, None] and fresh["name"] == "run-7"
    assert torch.equal(fresh["hidden"], expected["hidden"])  # type: ignore[arg-type]
    nested = fresh["nested"]
    assert isinstance(nested, dict) and nested["a"] == [(1, 2.0)] and nested["empty"] == {}
    assert type(nested["t"]) is tuple and torch.equal(nested["t"][0], torch.ones(2))
    for k, v in state["model"].state_dict().items():  # type: ignore[attr-defined]
        assert torch.equal(fresh["model"].state_dict()[k], v)  # type: ignore[attr-defined]


def test_plain_tensors_return_to_the_device_of_the_current_value(tmp_path: Path) -> None:
    save_once(tmp_path, {"h": torch.ones(2), "hs": (torch.ones(1), torch.zeros(1)), "c": None})
    # "meta" stands for any device other than the CPU the checkpoint is loaded onto
    fresh: dict[str, object] = {
        "h": torch.empty(2, device="meta"),
        "hs": (torch.empty(1, device="meta"), torch.empty(1)),
        "c": None,
    }
    resume(tmp_path, fresh)
    assert fresh["h"].device.type == "meta"  # type: ignore[attr-defined]
    devices = [t.device.type for t in fresh["hs"]]  # type: ignore[attr-defined]
    assert devices == ["meta", "cpu"]


def test_check_state_is_truthy_iff_the_mapping_has_entries() -> None:
    assert not check_state(None)
    assert not check_state({})
    assert check_state({"epoch": 0})
    assert check_state({"model": torch.nn.Linear(1, 1)})


class NoStateDict:
    pass


def cyclic() -> list[object]:
    loop: list[object] = []
    loop.append(loop)
    return loop


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (np.zeros(2), r"state\['x'\] \(numpy.ndarray\) has no state_dict\(\)/load_state_dict\(\)"),
        ({1, 2}, r"state\['x'\] \(set\) has no state_dict"),
        (NoStateDict(), r"state\['x'\] \(.*NoStateDict\) has no state_dict"),
        (np.float64(1.0), r"state\['x'\] \(numpy.float64\) has no state_dict"),
        ([1, {2}], r"state\['x'\]\[1\] \(set\) is not a plain value"),
        ({"a": {"b": (1, np.int64(2))}}, r"state\['x'\]\['a'\]\['b'\]\[1\] \(numpy.int64\)"),
        ({"a": {3: 1}}, r"state\['x'\]\['a'\] has the key 3 \(int\); dict keys must be str"),
        (cyclic(), r"nested more than 100 levels deep"),
    ],
)
def test_values_that_are_not_plain_are_refused(tmp_path: Path, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        PreemptionCheckpointHandler(tmp_path, {"x": value})
    assert "None, bool, int, float, str, torch.Tensor" in str(info.value)
    assert "\n" not in str(info.value)


def test_a_value_put_in_after_creation_is_checked_at_save_time(tmp_path: Path) -> None:
    state: dict[str, object] = {"epoch": 0}
    h = PreemptionCheckpointHandler(tmp_path, state)
    state["seen"] = {1, 2}
    with pytest.raises(ConfigError, match=r"state\['seen'\] \(set\)"):
        h.save()
    h.close()
    assert checkpoints(tmp_path) == []


def test_plain_values_need_a_mutable_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"must be a mutable mapping .* not mappingproxy"):
        PreemptionCheckpointHandler(tmp_path, types.MappingProxyType({"best": 1.0}))
    # objects alone are loaded in place: a read-only mapping is fine for them
    h = PreemptionCheckpointHandler(
        tmp_path, types.MappingProxyType({"model": torch.nn.Linear(1, 1)})
    )
    h.close()


def test_payload_functions_accept_a_plain_mapping(tmp_path: Path) -> None:
    payload = build_payload(4, {"epoch": 2})
    assert payload["plain"] == ["epoch"] and payload["state"] == {"epoch": 2}
    target: dict[str, object] = {"epoch": 0}
    apply_payload(payload, target, tmp_path / "x")
    assert target == {"epoch": 2}


# -- keys only one side has ----------------------------------------------------------------


def test_key_mismatch_warns_and_keeps_initial_values(tmp_path: Path, caplog) -> None:
    save_once(tmp_path, {"model": torch.nn.Linear(2, 2), "old": 1, "best": 0.5})
    sched_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    fresh: dict[str, object] = {
        "model": torch.nn.Linear(2, 2),
        "best": 9.0,
        "scheduler": torch.optim.lr_scheduler.StepLR(sched_opt, 1),
        "epoch": 7,
    }
    with caplog.at_level(logging.WARNING, logger="preemptible"):
        assert resume(tmp_path, fresh) == 0
    assert fresh["best"] == 0.5 and fresh["epoch"] == 7 and "old" not in fresh
    assert "no entry for 'scheduler', 'epoch'; left as initialized" in caplog.text
    assert "'old'; ignored" in caplog.text


# -- checkpoints that do not fit -----------------------------------------------------------


def test_other_shape_is_a_load_error_and_nothing_is_applied(tmp_path: Path) -> None:
    torch.manual_seed(1)
    save_once(tmp_path, {"a": torch.nn.Linear(2, 2), "model": torch.nn.Linear(2, 4), "n": 5}, 1)
    save_once(tmp_path, {"a": torch.nn.Linear(2, 2), "model": torch.nn.Linear(2, 4), "n": 6}, 2)
    a = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    fresh: dict[str, object] = {"a": a, "model": torch.nn.Linear(2, 8), "n": 0}
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointLoadError) as info:
        resume(tmp_path, fresh)
    newest = tmp_path / "step-0000000002.ckpt"
    assert str(info.value).startswith(
        f"checkpoint {newest} does not fit state['model']: 'weight' has shape (4, 2) in the "
        "checkpoint, (8, 2) in the model"
    )
    assert info.value.path == newest
    for k, v in a.state_dict().items():  # "a" fits, but is not loaded either
        assert torch.equal(v, before[k])
    assert fresh["n"] == 0 and torch.equal(torch.get_rng_state(), rng)
    # not quarantined, and the older checkpoint was not used instead
    assert checkpoints(tmp_path) == ["step-0000000001.ckpt", "step-0000000002.ckpt"]


class Net(torch.nn.Module):
    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        if extra:
            self.head = torch.nn.Linear(2, 1)


@pytest.mark.parametrize(
    ("saved_extra", "message"),
    [
        (False, "'head.weight' is in the model but not in the checkpoint"),
        (True, "'head.weight' is in the checkpoint but not in the model"),
    ],
)
def test_missing_or_unexpected_module_keys(tmp_path: Path, saved_extra: bool, message: str) -> None:
    save_once(tmp_path, {"model": Net(saved_extra)})
    with pytest.raises(CheckpointLoadError, match=f"does not fit state\\['model'\\]: {message}"):
        resume(tmp_path, {"model": Net(not saved_extra)})


class Picky:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, object]:
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        if sd["value"] == 13:
            raise ValueError("13 is not accepted\nsecond line of detail")
        self.value = sd["value"]  # type: ignore[assignment]


def test_other_load_failures_are_wrapped(tmp_path: Path) -> None:
    picky = Picky()
    picky.value = 13
    path = save_once(tmp_path, {"picky": picky})
    with pytest.raises(CheckpointLoadError) as info:
        resume(tmp_path, {"picky": Picky()})
    assert str(info.value).startswith(
        f"checkpoint {path} does not fit state['picky']: ValueError: 13 is not accepted;"
    )
    assert "\n" not in str(info.value)


def test_plain_value_where_an_object_is_now(tmp_path: Path) -> None:
    save_once(tmp_path, {"model": 3})
    with pytest.raises(CheckpointLoadError, match="plain value in the checkpoint, an object"):
        resume(tmp_path, {"model": torch.nn.Linear(1, 1)})
    payload = read_payload(tmp_path / "step-0000000000.ckpt", weights_only=True)
    assert payload["plain"] == ["model"]


def test_a_checkpoint_skips_torch_crc32_and_still_loads_bit_for_bit(tmp_path: Path) -> None:
    """The CRC32 of each record was the whole CPU cost of the save and torch.load never checks
    it: the payload is written without it, loads the same with weights_only, and torch's
    setting is back as it was for the program's own torch.save calls."""
    config = pytest.importorskip("torch.utils.serialization").config
    if not hasattr(config.save, "compute_crc32"):
        pytest.skip("this torch has no save.compute_crc32 setting")
    weight = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    path = save_once(tmp_path, {"model": torch.nn.ParameterList([torch.nn.Parameter(weight)])})
    with zipfile.ZipFile(path) as archive:
        records = [i for i in archive.infolist() if "/data/" in i.filename]
        assert records and all(i.CRC == 0 for i in records)
    payload = read_payload(path, weights_only=True)
    assert torch.equal(payload["state"]["model"]["0"], weight)
    assert config.save.compute_crc32 is True
