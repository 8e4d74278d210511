"""What a Keras checkpoint holds, and its file: a NumPy ``.npz`` of plain arrays.

Nothing in it is a pickle: every entry is a numeric array, loaded with
``allow_pickle=False``; the description (format, step, epoch, batch, variable paths, the
scalar parts of the random states) is JSON in a ``uint8`` array. A checkpoint holds

- ``model/i``: ``model.variables`` in order (weights, non-trainable state, the state of every
  ``SeedGenerator`` the layers own);
- ``optimizer/i``: ``model.optimizer.variables`` (iterations, learning rate, slots), and
  ``optimizer:NAME/i`` those of every other optimizer the model holds in an attribute (a GAN's
  ``self.d_optimizer``) or the callback was given in ``state=``; with each, the paths of the
  variables it was built for, so that a resumed fit builds it again before the first step. An
  optimizer that has not stepped by the save (the default one a GAN's ``compile()`` makes and
  never steps) is left out: a resumed fit makes it as it was;
- ``state:NAME/i``: the variables of the other Keras objects given in ``state=``;
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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np

from ..frontend import ConfigError

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
class Holdings:
    """What a checkpoint holds besides the model's own variables and metrics: the optimizers
    (by group name) and the variables of the objects given in ``state=`` (by group name)."""

    optimizers: dict[str, Any]
    others: dict[str, list[Any]]


def _refused(why: str) -> ConfigError:
    """The model holds state a Keras checkpoint cannot hold: the resume would not be exact."""
    return ConfigError(f"PreemptionCallback cannot resume this fit exactly: {why}")


def custom_train_step(model: Any) -> bool:
    return type(model).train_step is not keras.Model.train_step


def find_holdings(model: Any, state: Mapping[str, Any] | None) -> Holdings:
    """Every optimizer the fit may step (``model.optimizer``, those in the model's attributes,
    those of ``state``) and the variables of ``state``'s other objects. Raise ``ConfigError``
    naming an attribute whose state would be lost (a NumPy or torch generator, a torch module
    or optimizer, a TensorFlow variable or generator outside Keras)."""
    optimizers: dict[str, Any] = {}
    names: dict[int, str] = {}

    def add(name: str, optimizer: Any) -> None:
        if id(optimizer) in names:
            return
        if name in optimizers:
            raise _refused(f"two optimizers are named {name!r}: give state= another name")
        names[id(optimizer)] = name
        optimizers[name] = optimizer

    if getattr(model, "optimizer", None) is not None:
        add("optimizer", model.optimizer)
    for where, value in _attributes(model):
        if isinstance(value, keras.optimizers.Optimizer):
            add(f"optimizer:{where}", value)
        elif (kind := _unsaveable(value)) is not None:
            raise _refused(
                f"the model's attribute {where!r} is a {kind}: its state would not be saved and "
                "the resume would not be exact; keep it in Keras objects (keras.Variable, "
                "keras.random.SeedGenerator, a Keras optimizer or layer), or give them in state="
            )
    others: dict[str, list[Any]] = {}
    for name, obj in (state or {}).items():
        if not isinstance(name, str) or not name or "/" in name:
            raise _refused(f"state= names must be non-empty strings without '/', not {name!r}")
        if isinstance(obj, keras.optimizers.Optimizer):
            add(f"optimizer:{name}", obj)
        elif isinstance(obj, keras.Variable):
            others[f"state:{name}"] = [obj]
        elif isinstance(obj, keras.random.SeedGenerator):
            others[f"state:{name}"] = [obj.state]
        elif isinstance(obj, (keras.layers.Layer, keras.metrics.Metric)):
            others[f"state:{name}"] = list(obj.variables)
        else:
            raise _refused(
                f"state={name!r} is a {_kind(obj)}; state= takes Keras optimizers, layers, "
                "models, metrics, seed generators and variables"
            )
    return Holdings(optimizers, others)


def _attributes(model: Any) -> Iterator[tuple[str, Any]]:
    """The model's public attributes, and the items of those that are lists, tuples, dicts."""
    for name, value in vars(model).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                yield f"{name}[{i}]", item
        elif isinstance(value, dict):
            for key, item in value.items():
                yield f"{name}[{key!r}]", item
        else:
            yield name, value


def _kind(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _unsaveable(value: Any) -> str | None:
    """What ``value`` is, when it is state a Keras checkpoint does not see; else None."""
    if isinstance(value, (keras.Variable, keras.layers.Layer, keras.metrics.Metric)):
        return None  # the model tracks these: their variables are in the checkpoint
    if isinstance(value, (random.Random, np.random.Generator, np.random.RandomState)):
        return _kind(value)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(
        value, (torch.nn.Module, torch.optim.Optimizer, torch.Generator, torch.Tensor)
    ):
        return _kind(value)
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(value, (tf.Variable, tf.random.Generator, tf.Module)):
        return _kind(value)
    return None


def stepped(optimizer: Any) -> bool:
    """Whether ``optimizer`` has applied a step. One that has not holds what it was made with
    (a resumed fit makes it again): the default optimizer a GAN's ``compile()`` makes, built by
    fit and never stepped, stays out of the checkpoint."""
    return bool(optimizer.built) and int(keras.ops.convert_to_numpy(optimizer.iterations)) > 0


def built_for(optimizer: Any) -> list[Any]:
    """The variables ``optimizer`` was built for (Keras keeps them, privately; canary-tested)."""
    return list(getattr(optimizer, "_trainable_variables", []))


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
    groups: dict[str, list[np.ndarray]]  # optimizers and state=, restored with the model
    metrics: list[np.ndarray]
    epoch_rng: Rng
    batch_rng: Rng


def _numpy(variable: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(variable))


def _saved_groups(model: Any, holdings: Holdings) -> dict[str, list[Any]]:
    groups = {"model": list(model.variables), "metrics": list(model.metrics_variables)}
    for name, optimizer in holdings.optimizers.items():
        if stepped(optimizer):
            groups[name] = list(optimizer.variables)
    groups.update(holdings.others)
    return groups


def write_checkpoint(
    path: Path,
    model: Any,
    holdings: Holdings,
    position: Position,
    epoch_rng: Rng,
    batch_rng: Rng,
) -> None:
    groups = _saved_groups(model, holdings)
    built = {
        name: [str(v.path) for v in built_for(optimizer)]
        for name, optimizer in holdings.optimizers.items()
        if stepped(optimizer)
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
        "built_for": built,
        "rng": {"epoch": epoch_rng.scalars, "batch": batch_rng.scalars},
    }
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with open(path, "wb") as fh:  # a file object: np.savez would add ".npz" to a name
        np.savez(fh, **arrays)  # type: ignore[arg-type]


def read_checkpoint(path: Path, model: Any, holdings: Holdings) -> Checkpoint:
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
    saved_paths = meta.get("paths")
    if not isinstance(saved_paths, dict):
        raise ValueError("its description lists no variables")
    groups = {"model": list(model.variables)}
    for name in saved_paths:
        if name in ("model", "metrics"):
            continue
        if name in holdings.others:
            groups[name] = holdings.others[name]
        elif name in holdings.optimizers:
            groups[name] = _optimizer_variables(
                model, name, holdings.optimizers[name], meta.get("built_for", {}).get(name)
            )
        else:
            raise ValueError(f"it holds {name}, which this fit does not have")
    for name in holdings.others:
        if name not in groups:
            raise ValueError(f"it does not hold {name}")
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
    model_values = values.pop("model")
    metrics = values.pop("metrics")
    return Checkpoint(
        position,
        model_values,
        values,
        metrics,
        epoch_rng=rngs["epoch"],
        batch_rng=rngs["batch"],
    )


def _group(arrays: dict[str, np.ndarray], group: str) -> list[np.ndarray]:
    keys = [k for k in arrays if k.rpartition("/")[0] == group]
    return [arrays[k] for k in sorted(keys, key=lambda k: int(k.rpartition("/")[2]))]


def _optimizer_variables(model: Any, name: str, optimizer: Any, paths: Any) -> list[Any]:
    """The variables of ``optimizer`` as saved: one not built yet (an optimizer a custom
    ``train_step`` steps is built at its first step) is built for the model variables it was
    built for when saved, found by path, in the same order."""
    if optimizer.built:
        return list(optimizer.variables)
    if not isinstance(paths, list):
        raise ValueError(f"it does not say which variables {name} was built for")
    by_path: dict[str, Any] = {}
    for variable in model.variables:
        if str(variable.path) in by_path:
            raise ValueError(f"two model variables have the path {variable.path}")
        by_path[str(variable.path)] = variable
    missing = [p for p in paths if p not in by_path]
    if missing:
        raise ValueError(f"{name} was built for variables this model has not: {missing[:3]}")
    optimizer.build([by_path[p] for p in paths])
    return list(optimizer.variables)


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


def restore_variables(model: Any, holdings: Holdings, checkpoint: Checkpoint) -> None:
    for variable, value in zip(model.variables, checkpoint.model, strict=True):
        variable.assign(value)
    for name, values in checkpoint.groups.items():
        optimizer = holdings.optimizers.get(name)
        variables = optimizer.variables if optimizer is not None else holdings.others[name]
        for variable, value in zip(variables, values, strict=True):
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
