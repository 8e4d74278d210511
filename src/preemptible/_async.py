"""Asynchronous saves: the training loop stalls only for the copy to host memory.

At a save point the payload (state dicts, RNG states, the step) is built and every tensor in it
is copied on the training thread: a plain ``clone()`` on the CPU, a copy into pinned staging
buffers (reused from one save to the next) for tensors on a GPU. The copy is the snapshot; the
training loop goes on and may change its tensors while a background thread serializes,
writes, fsyncs and commits the snapshot through the same atomic store as a synchronous save.

At most one save is in flight. When the next save point comes while one is still writing, the
policy decides: ``"wait"`` (default) blocks until it is committed, then starts the next one;
``"skip"`` drops the new save point (logged) and keeps training. A failure in the background
is kept and reported at the next boundary; the previous checkpoints are untouched, as for any
refused save. A process killed while a save is in flight leaves the previous newest checkpoint
good: the store commits by rename, so nothing half-written ever has a final name.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ._checkpoint import CheckpointStore
from ._errors import CheckpointSaveError, ConfigError

logger = logging.getLogger("preemptible")

POLICIES = ("wait", "skip")


class HostSnapshot:
    """Copies every tensor of a nested payload to host memory; keeps pinned staging buffers
    for GPU tensors between saves (same place in the payload, same shape and dtype)."""

    def __init__(self) -> None:
        self._staging: dict[tuple[Any, ...], Any] = {}
        self.nbytes = 0  # bytes held in staging buffers

    def copy(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        import torch

        synced: list[bool] = []
        out = self._copy(payload, (), torch, synced)
        if synced and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies are done before we hand it on
        return dict(out)

    def _copy(self, value: Any, where: tuple[Any, ...], torch: Any, synced: list[bool]) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu":
                return value.detach().clone()
            buf = self._staging.get(where)
            if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                buf = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=True)
                self._staging[where] = buf
                self.nbytes = sum(b.numel() * b.element_size() for b in self._staging.values())
            buf.copy_(value.detach(), non_blocking=True)
            synced.append(True)
            # the staging buffer is reused by the next save, which starts only after this one
            # was committed (at most one in flight), so handing it on without a copy is safe
            return buf
        if isinstance(value, dict):
            copied = {k: self._copy(v, (*where, k), torch, synced) for k, v in value.items()}
            return copied if type(value) is dict else type(value)(copied)
        if isinstance(value, list):
            return [self._copy(v, (*where, i), torch, synced) for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self._copy(v, (*where, i), torch, synced) for i, v in enumerate(value))
        return value  # numbers, strings, None: immutable


class AsyncSaver:
    """One background save at a time into ``store``."""

    def __init__(self, store: CheckpointStore, *, policy: str = "wait") -> None:
        if policy not in POLICIES:
            raise ConfigError(f"async policy {policy!r} is not valid; use one of wait, skip")
        self.store = store
        self.policy = policy
        self.snapshot = HostSnapshot()
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._done: tuple[int, Path] | None = None
        self._error: CheckpointSaveError | None = None
        self.write_seconds: float | None = None  # the last background write, start to commit

    @property
    def in_flight(self) -> int | None:
        """The step being written, or None."""
        thread = self._thread
        return self._step if thread is not None and thread.is_alive() else None

    def submit(self, step: int, write: Callable[[Path], None]) -> bool:
        """Start writing ``write``'s checkpoint of ``step`` in the background; False when the
        save point was skipped (policy "skip" and a save still in flight)."""
        if self.in_flight is not None and self.policy == "skip":
            logger.warning(
                "preemptible: checkpoint of step %d skipped: the one of step %d is still "
                "being written (async policy 'skip')",
                step,
                self.in_flight,
            )
            return False
        self.wait()
        self._step = step
        thread = threading.Thread(
            target=self._run, args=(step, write), name="preemptible-async-save", daemon=False
        )
        self._thread = thread
        thread.start()
        return True

    def _run(self, step: int, write: Callable[[Path], None]) -> None:
        started = time.monotonic()
        try:
            path = self.store.save(step, write)
        except CheckpointSaveError as exc:
            self._error = exc
        except Exception as exc:  # pragma: no cover - store.save maps errors already
            self._error = CheckpointSaveError(f"background save of step {step} failed: {exc}")
        else:
            self._done = (step, path)
        self.write_seconds = time.monotonic() - started

    def wait(self) -> tuple[int, Path] | None:
        """Wait for the save in flight (if any); the newest committed (step, path) or None."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        return self._done

    def take_error(self) -> CheckpointSaveError | None:
        """The failure of the last background save, once (None when there was none)."""
        error, self._error = self._error, None
        return error
