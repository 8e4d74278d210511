"""Asynchronous saves: the training loop stalls only for the copy to host memory.

At a save point the payload (state dicts, RNG states, the step) is built and every tensor in it
is copied on the training thread into staging buffers kept from one save to the next: ordinary
memory for CPU tensors, page-locked memory for CUDA tensors. CUDA tensors are copied with
non-blocking copies on a side stream of their device (which first waits for the device's
current stream), and the training thread waits once per device, on an event, not per tensor.
The copy is the snapshot; the
training loop goes on and may change its tensors while a background thread serializes,
writes, fsyncs and commits the snapshot through the same atomic store as a synchronous save.

Why reuse buffers on the CPU too: a fresh allocation is faulted in page by page while it is
written, which costs several times the copy itself (about 1.7 s against 0.2 s per GB on a
2-core VM); into a reused buffer the copy is a plain memcpy. So that the first save does not pay
for it either, the buffers are allocated and faulted in by a thread at the first step boundary
(``HostSnapshot.prepare``); a tensor whose shape or dtype changed since gets a new buffer at the
save. The price is memory: the buffers (the size of the state) are held from the first step
boundary of a handler with ``async_save=True`` until it closes.

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

from .._errors import CheckpointSaveError, ConfigError
from ._store import CheckpointStore

logger = logging.getLogger("preemptible")

POLICIES = ("wait", "skip")


class HostSnapshot:
    """Copies every tensor of a nested payload to host memory, into staging buffers reused
    between saves (same place in the payload, same shape, dtype and pinning).

    ``free`` says whether the buffers may be overwritten now: a write still in flight reads
    them. When it says no, this copy goes to fresh memory and the buffers are left alone.
    ``prepare(payload)`` allocates the buffers ahead of the first copy, in a thread (see
    ``_Prestage``), so that the first save costs about what the later ones do.
    """

    def __init__(self, free: Callable[[], bool] | None = None) -> None:
        self._staging: dict[tuple[Any, ...], tuple[Any, bool]] = {}  # where: (buffer, pinned)
        self._free = free
        self._prestage: _Prestage | None = None
        self.prepared = False  # prepare() was called (once per handler is enough)
        self.nbytes = 0  # bytes held in staging buffers

    def prepare(self, payload: Mapping[str, Any]) -> None:
        """Allocate (and fault in) a staging buffer for every tensor of ``payload`` in a
        background thread; the next ``copy`` takes them. Only shapes and dtypes are read here:
        the values are copied at the save."""
        import torch

        self.prepared = True
        walk = _Copy(torch, None, layout_only=True)
        walk.value(payload, ())
        wanted = {w: spec for w, spec in walk.layout.items() if w not in self._staging}
        if wanted:
            self._prestage = _Prestage(torch, wanted)

    def _take_prestaged(self) -> None:
        prestage, self._prestage = self._prestage, None
        if prestage is not None:
            prestage.thread.join()
            for where, buf in prestage.buffers.items():
                self._staging.setdefault(where, buf)

    def copy(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        import torch

        reuse = self._free is None or self._free()
        if reuse:
            self._take_prestaged()
        run = _Copy(torch, self._staging if reuse else None)
        out = run.value(payload, ())
        run.finish()  # the copies from CUDA devices are done before the snapshot is handed on
        if reuse:  # a tensor gone from the payload no longer holds a buffer
            for where in set(self._staging) - run.used:
                del self._staging[where]
            self.nbytes = sum(b.numel() * b.element_size() for b, _ in self._staging.values())
        return dict(out)

    def release(self) -> None:
        """Drop the staging buffers (a write in flight keeps its own references)."""
        prestage, self._prestage = self._prestage, None
        if prestage is not None:
            prestage.thread.join()
        self._staging = {}
        self.nbytes = 0


def holds_cuda(value: Any) -> bool:
    """Whether a nested payload holds a tensor on a CUDA device (no CUDA call is made)."""
    if isinstance(value, dict):
        return any(holds_cuda(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(holds_cuda(v) for v in value)
    return getattr(value, "is_cuda", False) is True


class _Prestage:
    """Staging buffers allocated in a thread. A fresh buffer costs several times the copy into
    it (the kernel faults it in page by page on first write; pinned memory is also registered
    with the driver), so it is allocated and zeroed here, off the training thread: torch's
    kernels release the GIL, and the training loop goes on meanwhile."""

    def __init__(self, torch: Any, wanted: dict[tuple[Any, ...], tuple[Any, Any, bool]]) -> None:
        self.buffers: dict[tuple[Any, ...], tuple[Any, bool]] = {}

        def allocate() -> None:
            try:
                for where, (shape, dtype, pin) in wanted.items():
                    buf = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
                    buf.zero_()  # faults every page in now
                    self.buffers[where] = (buf, pin)
            except Exception as exc:  # out of memory, say: the save allocates as it goes
                logger.debug("preemptible: staging buffers not allocated ahead: %s", exc)

        self.thread = threading.Thread(target=allocate, name="preemptible-staging", daemon=True)
        self.thread.start()


class _Copy:
    """One snapshot: the walk through the payload, with what it used and the CUDA copies to
    wait for. ``layout_only``: walk without copying, noting what each staging buffer would be
    (``layout``: where -> (shape, dtype, pinned))."""

    def __init__(
        self, torch: Any, staging: dict[tuple[Any, ...], Any] | None, layout_only: bool = False
    ) -> None:
        self.torch = torch
        self.staging = staging  # None: copy to fresh memory, leave the buffers alone
        self.layout_only = layout_only
        self.layout: dict[tuple[Any, ...], tuple[Any, Any, bool]] = {}
        self.used: set[tuple[Any, ...]] = set()
        self.streams: dict[Any, Any] = {}  # CUDA device -> the side stream copying from it
        # one tensor at two places (tied weights: state_dict() gives two views of one
        # storage) stays one tensor, copied once, as torch.save of the live state keeps it
        self.seen: dict[tuple[Any, ...], Any] = {}

    def value(self, value: Any, where: tuple[Any, ...]) -> Any:
        if isinstance(value, self.torch.Tensor):
            t = value.detach()
            if t.layout != self.torch.strided:
                return self.tensor(t, where)
            key = (t.device, t.dtype, t.shape, t.stride(), t.storage_offset(), t.data_ptr())
            copied = self.seen.get(key)
            if copied is None:
                copied = self.seen[key] = self.tensor(t, where)
            return copied
        if isinstance(value, dict):
            copied = {k: self.value(v, (*where, k)) for k, v in value.items()}
            return copied if type(value) is dict else type(value)(copied)
        if isinstance(value, list):
            return [self.value(v, (*where, i)) for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self.value(v, (*where, i)) for i, v in enumerate(value))
        return value  # numbers, strings, None: immutable

    def tensor(self, t: Any, where: tuple[Any, ...]) -> Any:
        torch = self.torch
        device = t.device.type
        plain = type(t) is torch.Tensor and t.layout == torch.strided and not t.is_quantized
        if self.layout_only:
            if plain and device != "meta":
                self.layout[where] = (t.shape, t.dtype, device == "cuda")
            return t
        if not plain:
            # sparse, quantized, subclasses: no plain buffer to copy into
            return t.clone() if device in ("cpu", "meta") else t.to("cpu")
        if device == "meta":
            return t
        pin = device == "cuda"
        held = None if self.staging is None else self.staging.get(where)
        buf: Any = None if held is None else held[0]
        if held is None or buf.shape != t.shape or buf.dtype != t.dtype or held[1] != pin:
            # pin_memory only for CUDA: a CPU-only run never asks the CUDA runtime for anything
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            if self.staging is not None:
                self.staging[where] = (buf, pin)
        if self.staging is not None:
            self.used.add(where)
        if pin:
            self.cuda_copy(buf, t)
        else:
            buf.copy_(t)
        return buf

    def cuda_copy(self, buf: Any, t: Any) -> None:
        """A non-blocking device-to-host copy into pinned ``buf`` on a side stream of ``t``'s
        device. The side stream first waits for the device's current stream (the kernels that
        write ``t`` are queued there), so the copy reads the values the loop computed; nothing
        waits per tensor: ``finish`` waits once per device, on an event."""
        cuda = self.torch.cuda
        stream = self.streams.get(t.device)
        if stream is None:
            stream = self.streams[t.device] = cuda.Stream(device=t.device)
            stream.wait_stream(cuda.current_stream(t.device))
        with cuda.stream(stream):
            buf.copy_(t, non_blocking=True)

    def finish(self) -> None:
        """Wait for the CUDA copies (one event per device); then the host buffers hold the
        snapshot, and the loop may change its tensors."""
        events = []
        for device, stream in self.streams.items():
            event = self.torch.cuda.Event()
            event.record(stream)
            events.append((device, event))
        for _, event in events:
            event.synchronize()


class AsyncSaver:
    """One background save at a time into ``store``."""

    def __init__(self, store: CheckpointStore, *, policy: str = "wait") -> None:
        if policy not in POLICIES:
            raise ConfigError(f"async_policy={policy!r} is not valid; use one of wait, skip")
        self.store = store
        self.policy = policy
        self.snapshot = HostSnapshot(self._make_room)
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

    def save(
        self,
        step: int,
        payload: Mapping[str, Any],
        write: Callable[[Mapping[str, Any], Path], None],
    ) -> bool:
        """Snapshot ``payload`` here, then write it with ``write(snapshot, tmp)`` in the
        background; False when the save point was skipped (policy "skip", a save in flight:
        then nothing is copied either)."""
        if self.skips(step):
            return False
        snapshot = self.snapshot.copy(payload)  # after the write in flight (policy "wait")
        return self.submit(step, lambda tmp: write(snapshot, tmp))

    def submit(self, step: int, write: Callable[[Path], None]) -> bool:
        """Start writing ``write``'s checkpoint of ``step`` in the background; False when the
        save point was skipped (policy "skip" and a save still in flight)."""
        if self.skips(step):
            return False
        self.start(step, lambda: self.store.save(step, write))
        return True

    def start(self, step: int, job: Callable[[], Path]) -> None:
        """Run ``job`` (a save that returns the committed checkpoint) in the background, after
        the save in flight; its result or its CheckpointSaveError is collected like any
        background save's."""
        self.wait()
        self._step = step
        thread = threading.Thread(
            target=self._run, args=(step, job), name="preemptible-async-save", daemon=False
        )
        self._thread = thread
        thread.start()

    def skips(self, step: int) -> bool:
        """Whether the save point of ``step`` is dropped (policy "skip", a save in flight;
        logged)."""
        if self.in_flight is None or self.policy != "skip":
            return False
        logger.warning(
            "preemptible: checkpoint of step %d skipped: the one of step %d is still "
            "being written (async policy 'skip')",
            step,
            self.in_flight,
        )
        return True

    def _make_room(self) -> bool:
        """Before a snapshot: may it overwrite the staging buffers? With policy "wait" the
        write in flight (which reads them) is waited for here rather than at ``submit``;
        with "skip" the snapshot goes to fresh memory (``submit`` then skips it, or starts
        it if the write in flight has just finished)."""
        if self.in_flight is not None and self.policy == "skip":
            return False
        self.wait()
        return True

    def _run(self, step: int, job: Callable[[], Path]) -> None:
        started = time.monotonic()
        try:
            path = job()
        except CheckpointSaveError as exc:
            self._error = exc
        except Exception as exc:  # store.save maps its errors; a rank's wait may not
            self._error = CheckpointSaveError(
                f"background save of step {step} failed: {type(exc).__name__}: {exc}"
            )
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

    def close(self) -> None:
        """Wait for the save in flight and free the staging buffers (the next async save
        allocates them again)."""
        self.wait()
        self.snapshot.release()

    def take_error(self) -> CheckpointSaveError | None:
        """The failure of the last background save, once (None when there was none)."""
        error, self._error = self._error, None
        return error
