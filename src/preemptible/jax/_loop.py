"""``PreemptibleLoop``: the JAX front end of the kit, for a Flax NNX loop of one's own."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from ..frontend import (
    CheckpointLoadError,
    CheckpointSaveError,
    ConfigError,
    EpochLoop,
    Periodic,
    StagedSaver,
    TerminationConfig,
    checkpoint_directory,
    saving_config,
)
from ._store import jax_ranks

NAME = "checkpoint-{step}"
STATE = "state"  # Orbax's directory inside checkpoint-N
POSITION = "preemptible-{process}.json"  # beside it, one per process
FORMAT = "preemptible-jax/1"
_DONE = object()


def capture_rng() -> dict[str, Any]:
    """Python's and NumPy's global random states, as JSON (JAX has none of its own)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "python": [int(version), [int(k) for k in internal], gauss],
        "numpy": [str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }


def restore_rng(rng: Mapping[str, Any]) -> None:
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _check_rng(rng: Any) -> None:
    """Tried on throwaway generators: a bad state is refused before anything is restored."""
    if not isinstance(rng, dict):
        raise ValueError("its random states are not valid")
    version, internal, gauss = rng["python"]
    random.Random().setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.RandomState().set_state(
        (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
    )


class _OrbaxSaver(StagedSaver):
    """Orbax writes ``checkpoint-N/state`` into a temporary of the store, committed whole; a
    resume restores the newest that loads into the live objects."""

    def __init__(
        self, directory: Path | str, objects: dict[str, Any], checkpointer: Any, *, keep: int
    ) -> None:
        super().__init__(directory, NAME, keep=keep)
        self.objects = objects
        self.checkpointer = checkpointer
        self.position: dict[str, Any] | None = None  # the resumed checkpoint's

    def write(self, step: int, context: Any) -> Path:
        parent = self.stage(step)  # the same temporary on every process
        target = parent / self.name(step)
        try:
            target.mkdir(exist_ok=True)
            state = {name: nnx.state(obj) for name, obj in self.objects.items()}
            self.checkpointer.save((target / STATE).absolute(), state)  # Orbax: absolute only
            wait = getattr(self.checkpointer, "wait_until_finished", None)
            if wait is not None:  # an async checkpointer: the commit needs every byte
                wait()
            where = target / POSITION.format(process=jax.process_index())
            # the random states now, as the step (the boundary that saves) left them
            where.write_text(json.dumps({"format": FORMAT, **context, "rng": capture_rng()}))
        except Exception as exc:
            raise CheckpointSaveError(
                f"the Orbax save of step {step} failed: {type(exc).__name__}: {exc}",
                self.target(step),
            ) from exc
        return super().write(step, context)

    def resume(self, hint: Path | None) -> tuple[int, Path] | None:
        found = self.store.load_newest(self._load, pattern=self.pattern)
        if found is None:
            return None
        ckpt, step = found
        self.last = (step, ckpt.path)
        return self.last

    def _load(self, path: Path) -> int:
        where = path / POSITION.format(process=jax.process_index())
        if not where.is_file() or not (path / STATE).is_dir():
            raise CheckpointLoadError(
                f"{path} has no {STATE}/ and {where.name}: it was not saved by "
                "preemptible.jax.PreemptibleLoop (or by another number of processes)",
                path,
            )
        position = json.loads(where.read_text())
        if not isinstance(position, dict) or position.get("format") != FORMAT:
            raise CheckpointLoadError(f"{where} is not a {FORMAT} position", path)
        numbers = [position.get(k) for k in ("step", "epoch", "batch")]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
            raise CheckpointLoadError(
                f"{where}: step, epoch, batch = {numbers} are not valid", path
            )
        _check_rng(position.get("rng"))
        if position.get("epoch_rng") is not None:
            _check_rng(position["epoch_rng"])
        live = {name: nnx.state(obj) for name, obj in self.objects.items()}
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, live)
        # raises for a checkpoint of another model (Orbax checks the shapes)
        restored = self.checkpointer.restore((path / STATE).absolute(), target)
        for name, obj in self.objects.items():
            nnx.update(obj, restored[name])
        self.position = position
        return int(position["step"])


class PreemptibleLoop(EpochLoop):
    """Stop a Flax NNX training loop cleanly on a signal or a platform notice, as a committed
    ``checkpoint-N`` written by Orbax, and resume it bit for bit::

        model = MLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        loop = PreemptibleLoop("ckpt", state={"model": model, "optimizer": optimizer})
        for epoch in loop.epochs(num_epochs):
            for batch in loop.batches(dataset(epoch)):
                train_step(model, optimizer, batch)

    ``state``: the NNX objects whose state is the run's (modules, optimizers, ``nnx.Rngs``,
    metrics, variables), by name; they are saved with ``nnx.state`` and restored in place with
    ``nnx.update``. Create the loop after them: it resumes at once from the newest committed
    ``checkpoint-N`` in ``checkpoint_dir`` (None: the supervisor's
    ``PREEMPTIBLE_CHECKPOINT_DIR``; a bucket's URL, as for the other front ends). ``epochs``
    starts at the resumed epoch, ``batches`` at the resumed batch (the batches before it are
    drawn from the iterable, not trained on). On the first signal of ``signals`` (default INT,
    TERM, HUP, USR1, USR2) or a notice, the step finishes, the checkpoint is committed and the
    process exits 128 + signum (143 for a notice; ``exit_code``: a fixed code); a second
    signal exits at once with 1. ``save_every_steps``/``save_every_seconds``: periodic
    checkpoints (insurance against a SIGKILL); ``keep``: how many ``checkpoint-N`` are kept.
    When ``epochs`` ends, the last step is committed, so that running the command again trains
    nothing. ``checkpointer``: an Orbax checkpointer of your own (``save(path, item)``,
    ``restore(path, target)``); default ``ocp.StandardCheckpointer()``.

    ``step``: batches trained so far; ``epoch``, ``batch``: the epoch under way and the
    batches of it trained. One ``batches`` per epoch.
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        state: Mapping[str, Any] | None = None,
        *,
        keep: int = 2,
        save_every_steps: int | str | None = None,
        save_every_seconds: float | None = None,
        termination_config: TerminationConfig | None = None,
        signals: Iterable[int | str] | None = None,
        tracker: Any | None = None,
        exit_code: int | None = None,
        checkpointer: Any | None = None,
    ) -> None:
        objects = _objects(state)
        config = saving_config(termination_config, "preemptible.jax.PreemptibleLoop (Orbax)")
        periodic = Periodic.of(save_every_steps, save_every_seconds)
        if checkpointer is None:
            checkpointer = ocp.StandardCheckpointer()
        elif isinstance(checkpointer, ocp.CheckpointManager) or not all(
            callable(getattr(checkpointer, m, None)) for m in ("save", "restore")
        ):
            raise ConfigError(
                f"checkpointer={type(checkpointer).__name__} is not valid; give an Orbax "
                "checkpointer with save(path, item) and restore(path, target), such as "
                "ocp.StandardCheckpointer() (PreemptibleLoop names, keeps and commits the "
                "checkpoint-N directories itself, as a CheckpointManager would)"
            )
        saver = _OrbaxSaver(checkpoint_directory(checkpoint_dir), objects, checkpointer, keep=keep)
        super().__init__(  # the newest checkpoint, restored into the objects
            saver,
            termination_config=config,
            signals=signals,
            tracker=tracker,
            periodic=periodic,
            exit_code=exit_code,
            ranks=jax_ranks(),  # jax.distributed's processes agree on the stop step
        )
        # the random states as the resumed epoch's last step ended
        self._step_rng: dict[str, Any] | None = (saver.position or {}).get("rng")

    def _epoch_begins(self) -> None:
        if self._step_rng is not None and not self.batch:
            # resumed at an epoch's start (a stop at the end of the one before)
            restore_rng(self._step_rng)
            self._step_rng = None
        if self._epoch_rng is not None and self.batch:
            restore_rng(self._epoch_rng)  # the resumed epoch's data, drawn again
        else:
            self._epoch_rng = capture_rng()

    def batches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """The batches of ``iterable`` for this epoch, from the resumed batch; asking for the
        next one is the step's boundary."""
        return self._batches(iterable)

    def _batches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        session = self.session
        batches = iter(iterable)
        for drawn in range(self.batch):  # trained before the stop: drawn, not trained
            if next(batches, _DONE) is _DONE:
                raise ConfigError(
                    f"the resumed epoch {self.epoch} has {drawn} batches, the checkpoint says "
                    f"{self.batch} of it were trained; give batches() the same data"
                )
        if self.batch and self._step_rng is not None:
            restore_rng(self._step_rng)  # as the stopped run left them after its last step
        self._step_rng = None
        batch = next(batches, _DONE)
        while batch is not _DONE:
            yield batch
            self.batch += 1
            self.step += 1
            if session.at_boundary(step=self.step, context=self._position()):
                return
            batch = next(batches, _DONE)


def _objects(state: Mapping[str, Any] | None) -> dict[str, Any]:
    if not state or not isinstance(state, Mapping):
        raise ConfigError(
            f"state={state!r} is not valid; give the NNX objects to save by name, as "
            "state={'model': model, 'optimizer': optimizer}"
        )
    objects: dict[str, Any] = {}
    for name, obj in state.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"state= names must be non-empty strings without '/', not {name!r}")
        if not isinstance(obj, (nnx.Pytree, nnx.Variable)):  # modules, optimizers, Rngs
            raise ConfigError(
                f"state={name!r} is a {type(obj).__module__}.{type(obj).__qualname__}; "
                "state= takes Flax NNX objects (modules, optimizers, nnx.Rngs, metrics, "
                "variables), whose state is restored in place"
            )
        objects[name] = obj
    return objects


__all__ = ["PreemptibleLoop"]
