"""What goes into a checkpoint besides the user's objects: the step and every RNG state.

A resumed loop must draw the same random numbers as a loop that was never stopped (dropout
masks, augmentation, shuffling done with the global generators), so the states of
``random``, NumPy's legacy global generator and torch (CPU and, when initialised, CUDA) are
saved and put back. Everything is stored as plain containers and tensors so that the file
loads with ``torch.load(weights_only=True)``.

``state`` maps names to objects with ``state_dict()``/``load_state_dict()`` and to plain
values (numbers, strings, tensors and containers of them: what a training loop carries from
one step to the next, such as the best loss or an RNN's hidden state). The mapping is kept by
reference: plain values are read from it when a checkpoint is written and put back into it on
resume. They are restricted to what ``weights_only=True`` can load, so a resume never needs to
trust pickled code.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import random
import sys
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

from .._errors import CheckpointError, CheckpointLoadError, ConfigError, PreemptibleError

logger = logging.getLogger("preemptible")

FORMAT = "preemptible.checkpoint/1"


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


PLAIN_VALUES = (
    "None, bool, int, float, str, torch.Tensor, and lists, tuples and dicts (str keys) of them"
)
# Exact types: a subclass (numpy.float64, an IntEnum, a namedtuple) is pickled by class and
# then refuses to load with weights_only=True, so it is not a plain value.
_SCALARS = frozenset({type(None), bool, int, float, str})
_CONTAINERS = frozenset({list, tuple, dict})
_MAX_DEPTH = 100


class StateSpec:
    """The user's ``state`` mapping, held by reference, not copied.

    Plain values are read from it at save time (the loop rebinds ``state["best"] = ...``)
    and written back into it on resume. Truthy when the mapping has entries.
    """

    __slots__ = ("mapping",)

    def __init__(self, mapping: Mapping[str, Any]) -> None:
        self.mapping = mapping

    def __bool__(self) -> bool:
        return len(self.mapping) > 0

    def __len__(self) -> int:
        return len(self.mapping)

    def split(self) -> tuple[dict[str, Stateful], dict[str, Any]]:
        """(objects with state_dict(), plain values) as the mapping holds them now; raises
        ConfigError for anything else."""
        objects: dict[str, Stateful] = {}
        plain: dict[str, Any] = {}
        for key, obj in self.mapping.items():
            if type(key) is not str:
                raise ConfigError(f"state keys must be strings, got {key!r}")
            if isinstance(obj, Stateful):
                objects[key] = obj
                continue
            if type(obj) not in _SCALARS:
                _check_plain(obj, key)
            plain[key] = obj
        if plain and not isinstance(self.mapping, MutableMapping):
            raise ConfigError(
                f"state holds plain values ({', '.join(map(repr, plain))}), which are restored "
                f"into it, so it must be a mutable mapping such as a dict, not "
                f"{_type_name(self.mapping)}"
            )
        return objects, plain


def _type_name(value: object) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _is_tensor(value: object) -> bool:
    torch = sys.modules.get("torch")  # no tensor can exist before torch is imported
    return torch is not None and isinstance(value, torch.Tensor)


def _check_plain(value: Any, key: str) -> None:
    if type(value) not in _CONTAINERS and not _is_tensor(value):
        raise ConfigError(
            f"state[{key!r}] ({_type_name(value)}) has no state_dict()/load_state_dict() and is "
            f"not a plain value; pass modules, optimizers, schedulers, scalers, samplers or "
            f"plain values: {PLAIN_VALUES}"
        )
    bad = _find_not_plain(value, 0)
    if bad is not None:
        path, problem = bad
        where = f"state[{key!r}]" + "".join(f"[{p!r}]" for p in path)
        raise ConfigError(f"{where} {problem}; plain values are {PLAIN_VALUES}")


def _find_not_plain(value: Any, depth: int) -> tuple[list[object], str] | None:
    """The path to the first part of ``value`` that is not a plain value and what is wrong
    with it; None when all of it is plain. Cheap: no copies, one type test per element."""
    t = type(value)
    if t in _SCALARS or _is_tensor(value):
        return None
    if t not in _CONTAINERS:
        return [], f"({_type_name(value)}) is not a plain value"
    if depth >= _MAX_DEPTH:
        return [], f"is nested more than {_MAX_DEPTH} levels deep (does it contain itself?)"
    if t is dict:
        for k in value:
            if type(k) is not str:
                return [], f"has the key {k!r} ({_type_name(k)}); dict keys must be str"
        items: Any = value.items()
    else:
        items = enumerate(value)
    for k, v in items:
        if type(v) in _SCALARS:
            continue
        bad = _find_not_plain(v, depth + 1)
        if bad is not None:
            bad[0].insert(0, k)
            return bad
    return None


def check_state(state: Mapping[str, Any] | None) -> StateSpec:
    """Validate ``state`` when the handler is created; the result is truthy iff it has entries.

    Values are objects with state_dict()/load_state_dict() or plain values (see
    ``PLAIN_VALUES``); build_payload checks again, as the loop may add values later.
    """
    if state is None:
        return StateSpec({})
    if not isinstance(state, Mapping):
        raise ConfigError(
            "state must be a mapping of name -> object with state_dict()/load_state_dict() or "
            f"plain value, not {_type_name(state)}"
        )
    spec = StateSpec(state)
    spec.split()
    return spec


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise PreemptibleError(
            "saving state needs PyTorch: pip install 'preemptible[torch]', or pass "
            "TerminationConfig(save_fn=...) to save in your own format"
        ) from exc
    return torch


def _numpy() -> Any | None:
    if "numpy" in sys.modules or importlib.util.find_spec("numpy") is not None:
        import numpy

        return numpy
    return None


def capture_rng() -> dict[str, Any]:
    torch = _torch()
    rng: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        rng["numpy"] = (str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(cached))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: Mapping[str, Any]) -> None:
    torch = _torch()
    if "python" in rng:
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    np = _numpy()
    if np is not None and "numpy" in rng:
        kind, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in rng and torch.cuda.is_available():
        states = rng["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


def rng_problem(rng: Any) -> str | None:
    """What keeps ``rng`` from being restored, or None. Each state is tried on a throwaway
    generator, so a checkpoint that loads but holds garbage is refused before anything of it
    is put back (the model's weights included)."""
    if not isinstance(rng, Mapping):
        return f"its random states are a {_type_name(rng)}, not a mapping"
    try:
        if "python" in rng:
            version, internal, gauss = rng["python"]
            random.Random().setstate((version, tuple(internal), gauss))
        if "torch" in rng:
            _torch().Generator().set_state(rng["torch"])
        np = _numpy()
        if np is not None and "numpy" in rng:
            kind, keys, pos, has_gauss, cached = rng["numpy"]
            state = (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
            np.random.RandomState().set_state(state)
        if "cuda" in rng and not (
            isinstance(rng["cuda"], list | tuple) and all(map(_is_tensor, rng["cuda"]))
        ):
            raise TypeError("the CUDA states are not a list of tensors")
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"its random states do not restore ({type(exc).__name__}: {first})"
    return None


def payload_problem(payload: Mapping[str, Any]) -> str | None:
    """What is malformed in a loaded payload (one that loads with ``weights_only`` but was not
    written by preemptible), or None."""
    saved = payload.get("state", {})
    if not isinstance(saved, Mapping) or not all(isinstance(k, str) for k in saved):
        return "its state is not a mapping of names"
    plain = payload.get("plain", ())
    if not isinstance(plain, list | tuple) or not all(isinstance(k, str) for k in plain):
        return "its list of plain values is not a list of names"
    ranks = payload.get("rng_ranks")
    if ranks is not None and not isinstance(ranks, list):
        return "its per-rank random states are not a list"
    for rng in [payload.get("rng", {}), *(ranks or [])]:
        if (problem := rng_problem(rng)) is not None:
            return problem
    return None


def build_payload(step: int, state: StateSpec | Mapping[str, Any]) -> dict[str, Any]:
    spec = state if isinstance(state, StateSpec) else check_state(state)
    objects, plain = spec.split()  # again: the loop may have put a new value in since
    saved: dict[str, Any] = {name: obj.state_dict() for name, obj in objects.items()}
    saved.update(plain)  # as they are: torch.save copies tensors while it writes
    return {
        "format": FORMAT,
        "step": step,
        "saved_at": time.time(),
        "state": saved,
        "plain": sorted(plain),
        "rng": capture_rng(),
    }


class _RecordingWriter:
    """A file wrapper that keeps the OSError of a failed write: torch's serializer turns it
    into a RuntimeError ("unexpected pos ...") that no longer says what went wrong."""

    def __init__(self, fh: Any) -> None:
        self._fh = fh
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self._fh.write(data))
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        try:
            self._fh.flush()
        except OSError as exc:
            self.error = exc
            raise


def without_crc32() -> Any:
    """torch.save without the CRC32 of each record, where torch can be told so (2.6 and later).

    The CRC was the whole CPU cost of serializing (about 0.16 s per GB here, a third of writing
    and fsyncing the same bytes on a fast disk: the storages themselves are written without a
    copy), and nothing reads it: ``torch.load`` does not check it (a flipped byte loads either
    way), while the store's commit (fsync, rename) is what guarantees a checkpoint is whole.
    The file stays the same zip archive with the same records; ``weights_only`` loads are
    unchanged."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(config.save, "compute_crc32"):
        return contextlib.nullcontext()
    return cast(Any, config).patch({"save.compute_crc32": False})


def write_payload(payload: Mapping[str, Any], path: Path) -> None:
    # Opened here rather than by torch, so that a refused open or write surfaces as the
    # OSError with its errno (ENOSPC, EROFS, EACCES), not as a RuntimeError from C++.
    torch = _torch()
    with open(path, "wb") as fh:
        writer = _RecordingWriter(fh)
        try:
            with without_crc32():
                torch.save(dict(payload), writer)
            writer.flush()
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise


def read_payload(path: Path, *, weights_only: bool) -> dict[str, Any]:
    torch = _torch()
    payload = torch.load(str(path), map_location="cpu", weights_only=weights_only)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a preemptible checkpoint", path)
    if not isinstance(payload.get("step"), int) or payload["step"] < 0:
        raise CheckpointError(f"{path} has no valid step", path)
    if (problem := payload_problem(payload)) is not None:
        raise CheckpointError(f"{path} is not a valid preemptible checkpoint: {problem}", path)
    return payload


def apply_payload(
    payload: Mapping[str, Any], state: StateSpec | Mapping[str, Any], path: Path
) -> None:
    """Put a checkpoint back into ``state``: all of it, or (when it does not fit) nothing.

    Keys only one side has are warned about, not errors: a new entry keeps its initial value,
    an entry the code no longer has is ignored. Every object is checked before any is loaded
    (``CheckpointLoadError`` naming the first key that does not fit); plain values are
    written back into the mapping.
    """
    spec = state if isinstance(state, StateSpec) else check_state(state)
    objects, plain = spec.split()
    saved: Mapping[str, Any] = payload.get("state", {})
    saved_plain = set(payload.get("plain", ()))
    absent = [name for name in spec.mapping if name not in saved]
    if absent:
        logger.warning(
            "preemptible: checkpoint %s has no entry for %s; left as initialized",
            path,
            ", ".join(map(repr, absent)),
        )
    ignored = [name for name in saved if name not in spec.mapping]
    if ignored:
        logger.warning(
            "preemptible: checkpoint %s has entries the state does not: %s; ignored",
            path,
            ", ".join(map(repr, ignored)),
        )

    def misfit(name: str, problem: str) -> CheckpointLoadError:
        return CheckpointLoadError(
            f"checkpoint {path} does not fit state[{name!r}]: {problem}; was it saved by "
            "other code? Move it away to start over",
            path,
        )

    if (problem := payload_problem(payload)) is not None:  # a sharded one's RNG file too
        raise CheckpointLoadError(f"checkpoint {path}: {problem}; nothing was loaded", path)
    for name, obj in objects.items():
        if name in saved_plain:
            raise misfit(name, "it is a plain value in the checkpoint, an object now")
        if name in saved and (problem := _misfit(obj, saved[name])) is not None:
            raise misfit(name, problem)
    for name in plain:
        if name in saved and name not in saved_plain:
            raise misfit(
                name, "it is an object's state_dict() in the checkpoint, a plain value now"
            )

    for name, obj in objects.items():
        if name in saved:
            try:
                obj.load_state_dict(saved[name])
            except Exception as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise misfit(name, f"{type(exc).__name__}: {first}") from exc
    if plain:
        mapping = spec.mapping
        assert isinstance(mapping, MutableMapping)  # split() refuses plain values otherwise
        for name, current in plain.items():
            if name in saved:
                mapping[name] = _onto_devices_of(saved[name], current)
    restore_rng(payload.get("rng", {}))


def _misfit(obj: Stateful, saved: Any) -> str | None:
    """What keeps ``saved`` from loading into ``obj``, or None. Key sets are compared for
    modules only (their load is strict); other objects may legitimately save optional keys."""
    current = obj.state_dict()
    if not isinstance(current, Mapping) or not isinstance(saved, Mapping):
        return None
    torch = sys.modules.get("torch")
    if torch is None:  # no module, no tensor: nothing to compare
        return None
    is_module = isinstance(obj, torch.nn.Module)
    here = "the model" if is_module else "the object"
    for key, value in current.items():
        if key not in saved:
            if is_module:
                return f"{key!r} is in {here} but not in the checkpoint"
            continue
        old = saved[key]
        if (
            _is_tensor(value)
            and _is_tensor(old)
            and not torch.nn.parameter.is_lazy(value)
            and tuple(value.shape) != tuple(old.shape)
        ):
            shapes = f"{tuple(old.shape)} in the checkpoint, {tuple(value.shape)} in {here}"
            return f"{key!r} has shape {shapes}"
    if is_module:
        for key in saved:
            if key not in current:
                return f"{key!r} is in the checkpoint but not in {here}"
    return None


def _onto_devices_of(saved: Any, current: Any) -> Any:
    """Checkpoints load onto the CPU; a tensor the mapping already holds on another device
    (an RNN's hidden state on the GPU) says where the restored one belongs."""
    if _is_tensor(saved) and _is_tensor(current):
        return saved if saved.device == current.device else saved.to(current.device)
    kind = type(saved)
    if kind is not type(current):
        return saved
    if kind in (list, tuple) and len(saved) == len(current):
        return kind(_onto_devices_of(s, c) for s, c in zip(saved, current, strict=True))
    if kind is dict:
        return {k: _onto_devices_of(v, current[k]) if k in current else v for k, v in saved.items()}
    return saved
