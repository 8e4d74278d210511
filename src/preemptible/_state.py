"""What goes into a checkpoint besides the user's objects: the step and every RNG state.

A resumed loop must draw the same random numbers as a loop that was never stopped (dropout
masks, augmentation, shuffling done with the global generators), so the states of
``random``, NumPy's legacy global generator and torch (CPU and, when initialised, CUDA) are
saved and put back. Everything is stored as plain containers and tensors so that the file
loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ._errors import CheckpointError, ConfigError, PreemptibleError

FORMAT = "preemptible.checkpoint/1"


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


def check_state(state: Mapping[str, Any] | None) -> dict[str, Stateful]:
    if state is None:
        return {}
    if not isinstance(state, Mapping):
        raise ConfigError(
            f"state must be a mapping of name -> object with state_dict()/load_state_dict(), "
            f"not {type(state).__name__}"
        )
    out: dict[str, Stateful] = {}
    for key, obj in state.items():
        if not isinstance(key, str):
            raise ConfigError(f"state keys must be strings, got {key!r}")
        if not isinstance(obj, Stateful):
            raise ConfigError(
                f"state[{key!r}] ({type(obj).__name__}) has no state_dict()/load_state_dict(); "
                "pass modules, optimizers, schedulers, scalers or samplers"
            )
        out[key] = obj
    return out


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


def build_payload(step: int, state: Mapping[str, Stateful]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "step": step,
        "saved_at": time.time(),
        "state": {name: obj.state_dict() for name, obj in state.items()},
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


def write_payload(payload: Mapping[str, Any], path: Path) -> None:
    # Opened here rather than by torch, so that a refused open or write surfaces as the
    # OSError with its errno (ENOSPC, EROFS, EACCES), not as a RuntimeError from C++.
    torch = _torch()
    with open(path, "wb") as fh:
        writer = _RecordingWriter(fh)
        try:
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
    return payload


def apply_payload(payload: Mapping[str, Any], state: Mapping[str, Stateful], path: Path) -> None:
    saved = payload.get("state", {})
    missing = [name for name in state if name not in saved]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} has no entry for {', '.join(map(repr, missing))} "
            f"(it has {', '.join(map(repr, saved)) or 'none'}); the state keys must match "
            "the run that saved it",
            path,
        )
    for name, obj in state.items():
        obj.load_state_dict(saved[name])
    restore_rng(payload.get("rng", {}))
