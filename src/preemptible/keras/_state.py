"""What a Keras checkpoint holds, and its file: a NumPy ``.npz`` of plain arrays.

Nothing in it is a pickle: every entry is a numeric array, loaded with
``allow_pickle=False``; the description (format, step, epoch, batch, variable paths, the
scalar parts of the random states) is JSON in a ``uint8`` array. A checkpoint holds

- ``model/i``: ``model.variables`` in order (weights, non-trainable state, the state of every
  ``SeedGenerator`` the layers own);
- ``optimizer/i``: ``optimizer.variables`` (iterations, learning rate, slots);
- ``metrics/i``: ``model.metrics_variables`` (the epoch's running loss and metrics, so that
  the resumed epoch logs what the uninterrupted one did);
- ``rng/epoch/*`` and ``rng/batch/*``: the global random states (Python's ``random``, NumPy's
  legacy generator, torch's CPU generator on the torch backend) as they were when the epoch
  began and when the saved batch ended.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np

FORMAT = "preemptible-keras/1"


@dataclass(frozen=True)
class Rng:
    """A snapshot of the global random states: arrays, and the scalars beside them."""

    arrays: dict[str, np.ndarray]
    scalars: dict[str, Any]


def capture_rng() -> Rng:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    arrays = {"python": np.asarray(internal, dtype=np.uint32), "numpy": np.array(keys)}
    scalars = {
        "python": [int(version), gauss],
        "numpy": [str(kind), int(pos), int(has_gauss), float(cached)],
    }
    torch = _torch()
    if torch is not None:
        arrays["torch"] = torch.get_rng_state().numpy().copy()
    return Rng(arrays, scalars)


def restore_rng(rng: Rng) -> None:
    version, gauss = rng.scalars["python"]
    random.setstate((version, tuple(int(k) for k in rng.arrays["python"]), gauss))
    kind, pos, has_gauss, cached = rng.scalars["numpy"]
    np.random.set_state((kind, rng.arrays["numpy"], pos, has_gauss, cached))
    torch = _torch()
    if torch is not None and "torch" in rng.arrays:
        torch.set_rng_state(torch.from_numpy(rng.arrays["torch"].copy()))


def _torch() -> Any | None:
    """torch, when it is the backend (its global generator feeds dropout and shuffling)."""
    if keras.backend.backend() != "torch":
        return None
    return sys.modules.get("torch")


@dataclass(frozen=True)
class Position:
    """Where the fit was: ``step`` batches trained in all, ``batch`` of them in ``epoch``.
    ``finished``: the fit had trained to its end (a fit resumed from it trains nothing)."""

    step: int
    epoch: int
    batch: int
    finished: bool = False


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as read, checked against the model it is for."""

    position: Position
    model: list[np.ndarray]
    optimizer: list[np.ndarray]
    metrics: list[np.ndarray]
    epoch_rng: Rng
    batch_rng: Rng


def _numpy(variable: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(variable))


def write_checkpoint(
    path: Path, model: Any, position: Position, epoch_rng: Rng, batch_rng: Rng
) -> None:
    groups = {
        "model": list(model.variables),
        "optimizer": list(model.optimizer.variables),
        "metrics": list(model.metrics_variables),
    }
    arrays: dict[str, np.ndarray] = {}
    for group, variables in groups.items():
        for i, variable in enumerate(variables):
            arrays[f"{group}/{i}"] = _numpy(variable)
    for name, rng in (("epoch", epoch_rng), ("batch", batch_rng)):
        for kind, array in rng.arrays.items():
            arrays[f"rng/{name}/{kind}"] = array
    meta = {
        "format": FORMAT,
        "backend": keras.backend.backend(),
        "step": position.step,
        "epoch": position.epoch,
        "batch": position.batch,
        "finished": position.finished,
        "paths": {g: [str(getattr(v, "path", "")) for v in vs] for g, vs in groups.items()},
        "rng": {"epoch": epoch_rng.scalars, "batch": batch_rng.scalars},
    }
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with open(path, "wb") as fh:  # a file object: np.savez would add ".npz" to a name
        np.savez(fh, **arrays)  # type: ignore[arg-type]


def read_checkpoint(path: Path, model: Any) -> Checkpoint:
    """Read ``path`` and check it against ``model``; raise ``ValueError`` when it is not a
    checkpoint of this model (nothing is restored until every part has been checked)."""
    with np.load(path, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    if "meta" not in arrays:
        raise ValueError("not a preemptible Keras checkpoint (no description)")
    meta = json.loads(arrays.pop("meta").tobytes().decode())
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} checkpoint")
    numbers = [meta.get(k) for k in ("step", "epoch", "batch")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
        raise ValueError(f"its position is not valid: step, epoch, batch = {numbers}")
    if meta.get("backend") != keras.backend.backend():
        raise ValueError(
            f"it was written on the {meta.get('backend')} backend, this fit runs on "
            f"{keras.backend.backend()} (its random states do not carry over)"
        )
    groups = {"model": list(model.variables), "optimizer": list(model.optimizer.variables)}
    values: dict[str, list[np.ndarray]] = {"metrics": _group(arrays, "metrics")}
    for group, variables in groups.items():
        saved = _group(arrays, group)
        if len(saved) != len(variables):
            raise ValueError(
                f"it holds {len(saved)} {group} variables, this model has {len(variables)}"
            )
        values[group] = []
        for array, variable in zip(saved, variables, strict=True):
            want = (tuple(variable.shape), np.dtype(variable.dtype))
            if (array.shape, array.dtype) != want:
                raise ValueError(
                    f"{group} variable {variable.path}: saved as {array.dtype}{list(array.shape)}, "
                    f"the model's is {want[1]}{list(want[0])}"
                )
            values[group].append(array)
    rngs = {}
    for name in ("epoch", "batch"):
        prefix = f"rng/{name}/"
        kinds = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
        rng = Rng(kinds, meta["rng"][name])
        _check_rng(rng)
        rngs[name] = rng
    position = Position(meta["step"], meta["epoch"], meta["batch"], bool(meta.get("finished")))
    return Checkpoint(
        position,
        values["model"],
        values["optimizer"],
        values["metrics"],
        epoch_rng=rngs["epoch"],
        batch_rng=rngs["batch"],
    )


def _group(arrays: dict[str, np.ndarray], group: str) -> list[np.ndarray]:
    keys = [k for k in arrays if k.startswith(f"{group}/")]
    return [arrays[k] for k in sorted(keys, key=lambda k: int(k.split("/")[1]))]


def _check_rng(rng: Rng) -> None:
    """Try every state on a throwaway generator: garbage is refused before anything of the
    checkpoint is put back."""
    version, gauss = rng.scalars["python"]
    random.Random().setstate((version, tuple(int(k) for k in rng.arrays["python"]), gauss))
    kind, pos, has_gauss, cached = rng.scalars["numpy"]
    np.random.RandomState().set_state((kind, rng.arrays["numpy"], pos, has_gauss, cached))
    torch = _torch()
    if torch is not None:
        if "torch" not in rng.arrays:
            raise ValueError("it holds no torch random state")
        torch.Generator().set_state(torch.from_numpy(rng.arrays["torch"].copy()))


def restore_variables(model: Any, checkpoint: Checkpoint) -> None:
    for variable, value in zip(model.variables, checkpoint.model, strict=True):
        variable.assign(value)
    for variable, value in zip(model.optimizer.variables, checkpoint.optimizer, strict=True):
        variable.assign(value)


def restore_metrics(model: Any, checkpoint: Checkpoint) -> bool:
    """Put the epoch's running metrics back; False when the model's metric variables are not
    (yet) those saved: TensorFlow builds compiled metrics at the first training step."""
    variables = list(model.metrics_variables)
    saved = checkpoint.metrics
    if len(variables) != len(saved) or any(
        tuple(v.shape) != a.shape for v, a in zip(variables, saved, strict=True)
    ):
        return False
    for variable, value in zip(variables, saved, strict=True):
        variable.assign(value)
    return True
