"""``PreemptionCheckpointHandler``: TensorFlow's handler's API on the kit."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import tensorflow as tf

from ..frontend import (
    CheckpointStore,
    ConfigError,
    Periodic,
    Phase,
    PreemptibleError,
    StopSession,
    TerminationConfig,
    checkpoint_directory,
    exit_code_of,
    saving_config,
)
from ._coordination import WorkersSaver, task_of, workers_of

logger = logging.getLogger("preemptible")
R = TypeVar("R")
NAME = "tf-{step}"
PREFIX = "ckpt"  # inside a checkpoint's directory: ckpt.index, ckpt.data-00000-of-00001


def _termination_config(given: Any) -> TerminationConfig | None:
    """Ours, or TensorFlow's ``TerminationConfig`` (the same four fields; its ``exit_fn``
    takes no argument, ours the exit code: both are accepted)."""
    if given is None or isinstance(given, TerminationConfig):
        config = given
    else:
        fields = ("termination_watcher_fn", "exit_fn", "grace_period", "save_fn")
        if not all(hasattr(given, f) for f in fields):
            raise ConfigError(
                f"termination_config={given!r} is not valid; use preemptible.TerminationConfig "
                "or tf.distribute.experimental.TerminationConfig"
            )
        config = TerminationConfig(**{f: getattr(given, f) for f in fields})
    if config is not None and config.exit_fn is not None and _takes_no_argument(config.exit_fn):
        exit_fn = config.exit_fn
        config.exit_fn = lambda code: exit_fn()  # type: ignore[call-arg]
    return saving_config(
        config,
        "the TensorFlow PreemptionCheckpointHandler (it writes the tf.train.Checkpoint itself, "
        "into a directory it commits atomically)",
    )


def _takes_no_argument(fn: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called with the code
        return False
    return not any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters
    )


def _build_optimizers(checkpoint: Any) -> None:
    """Build the Keras optimizers of ``checkpoint`` before it is read. Once a Keras 3
    optimizer is built, ``tf.train.Checkpoint`` saves the model's variables under the
    optimizer (``optimizer/_trainable_variables/i``), not under the model: read into an
    optimizer not built yet, they would be put back only when the first step builds it, inside
    that step, after the model was used. With one Keras model beside it in the checkpoint, an
    optimizer is built for that model's trainable variables, as its first
    ``apply_gradients(zip(grads, model.trainable_variables))`` would."""
    keras = sys.modules.get("keras")
    if keras is None:
        return
    children = [v for k, v in vars(checkpoint).items() if not k.startswith("_")]
    models = [c for c in children if isinstance(c, keras.Model)]
    for child in children:
        if isinstance(child, keras.optimizers.Optimizer) and not child.built and len(models) == 1:
            try:
                child.build(models[0].trainable_variables)
            except RuntimeError as exc:  # a strategy's variables, out of its scope
                logger.warning(
                    "preemptible: the optimizer is restored when its first step builds it "
                    "(%s); create the handler in the strategy's scope, as TensorFlow's docs do",
                    exc,
                )


def _seed_states(checkpoint: Any) -> dict[str, list[Any]]:
    """The states of the Keras ``SeedGenerator``s of the Keras layers and models in
    ``checkpoint``, by the checkpoint's attribute. A layer's dropout draws its masks from such a
    generator, whose state is one of ``layer.variables`` but not of ``layer.weights``, and
    ``tf.train.Checkpoint`` saves only the weights: without these, a resumed run would draw the
    masks of a run's first steps again, and not end as one never stopped."""
    keras = sys.modules.get("keras")
    if keras is None:
        return {}
    states: dict[str, list[Any]] = {}
    for name, child in vars(checkpoint).items():
        if name.startswith("_") or not isinstance(child, keras.layers.Layer):
            continue
        weights = {id(w) for w in child.weights}
        if extra := [v for v in child.variables if id(v) not in weights]:
            states[name] = extra
    return states


class PreemptionCheckpointHandler:
    """TensorFlow's ``PreemptionCheckpointHandler``, with preemption's stop path::

        from preemptible.tensorflow import PreemptionCheckpointHandler  # the one change

        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
        handler = PreemptionCheckpointHandler(resolver, checkpoint, checkpoint_dir="ckpt/")
        for step in range(handler.total_run_calls, STEPS):
            handler.run(train_step, next(iterator))

    Created, it restores the newest committed checkpoint of ``checkpoint_dir`` (the
    ``tf.train.Checkpoint`` given, or a ``tf.train.CheckpointManager``'s checkpoint and
    directory), the number of ``run()`` calls made (``total_run_calls``), TensorFlow's
    global random generator and the ``SeedGenerator``s of its Keras models (dropout's).
    ``run(fn, *args, **kwargs)`` calls ``fn`` once; before it, a stop that was requested
    (the first signal of ``signals``, default INT, TERM, HUP, USR1, USR2,
    or a notice of ``termination_config``: the detected platform's by default) commits
    ``tf-<total_run_calls>`` and exits with 128 + signum (143 for a notice), or ``exit_code``
    (``exit_code=42``: TensorFlow's), or calls ``termination_config.exit_fn`` (with no
    argument, as TensorFlow's, or with the code). A second signal exits at once with code 1.
    ``checkpoint_dir`` may be a bucket's URL, as for the other front ends; ``keep``,
    ``save_every_steps``/``save_every_seconds`` and ``tracker`` as for
    ``preemptible.PreemptionCheckpointHandler``.

    ``cluster_resolver``: the strategy's (``strategy.cluster_resolver``). With several workers
    (a ``MultiWorkerMirroredStrategy``, ``TF_CONFIG``), a stop that reaches any one worker is
    acted on by all of them before the same ``run()`` call (agreed in TensorFlow's
    coordination service, with no collective per step): every worker writes the checkpoint
    (as TensorFlow's handler, since writing may read variables collectively), the chief's is
    the one committed, into ``checkpoint_dir`` (a directory every worker reads, or a bucket),
    and every worker exits with the same code, that of the first stop.
    ``termination_config.save_fn`` is refused: the handler writes the checkpoint itself.
    """

    def __init__(
        self,
        cluster_resolver: Any,
        checkpoint_or_checkpoint_manager: Any,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        termination_config: Any = None,
        *,
        signals: Iterable[int | str] | None = None,
        exit_code: int | None = None,
        keep: int = 2,
        save_every_steps: int | str | None = None,
        save_every_seconds: float | None = None,
        tracker: Any | None = None,
    ) -> None:
        try:
            rank, world = task_of(cluster_resolver)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        given = checkpoint_or_checkpoint_manager
        if isinstance(given, tf.train.CheckpointManager):
            checkpoint, directory = given.checkpoint, checkpoint_dir or given.directory
        elif isinstance(given, tf.train.Checkpoint):
            checkpoint, directory = given, checkpoint_dir
            if not directory:
                raise ConfigError(
                    "checkpoint_dir is required with a tf.train.Checkpoint (as for "
                    "TensorFlow's handler); or pass a tf.train.CheckpointManager"
                )
        else:
            raise ConfigError(
                f"checkpoint_or_checkpoint_manager={given!r} is not valid; use a "
                "tf.train.Checkpoint or a tf.train.CheckpointManager"
            )
        self.cluster_resolver = cluster_resolver
        self.checkpoint = checkpoint
        self.termination_config = _termination_config(termination_config)
        self._calls = tf.Variable(0, dtype=tf.int64, trainable=False, name="total_run_calls")
        self._saved = tf.train.Checkpoint(
            checkpoint=checkpoint,
            total_run_calls=self._calls,
            rng=tf.random.get_global_generator(),
            keras_seeds=_seed_states(checkpoint),  # dropout's, not among the layers' weights
        )
        self.store = CheckpointStore(checkpoint_directory(directory), keep=keep)
        periodic = Periodic.of(save_every_steps, save_every_seconds)
        # every worker writes (a collective may read a variable), the chief's is committed
        saver = WorkersSaver(self.store, NAME, self._write, load=self._load, writer=rank == 0)
        self._session = StopSession(
            saver,
            termination_config=self.termination_config,
            signals=signals,
            tracker=tracker,
            periodic=periodic,
            exit_code=exit_code_of(exit_code),
            ranks=workers_of(cluster_resolver) if world > 1 else None,
        )
        self._open = True
        self._session.start()
        try:
            self._session.begin()  # TensorFlow's handler restores when it is made
        except BaseException:
            self._session.close()
            raise

    # -- TensorFlow's API ------------------------------------------------------------------
    @property
    def total_run_calls(self) -> int:
        """The calls of ``run()`` made, those before the restart counted (restored)."""
        return self._session.step

    @property
    def checkpoint_dir(self) -> Path:
        return self.store.directory

    @property
    def resume_path(self) -> Path | None:
        """The checkpoint this run resumed from, if any."""
        return self._session.resume_path

    def run(self, distributed_train_function: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Act on a stop requested before this step (save, exit), then run one step."""
        session = self._session
        if session.stopped:
            raise PreemptibleError("this handler has already stopped the run; create a new one")
        session.at_boundary(step=session.step)  # an exit_fn that returns: the step still runs
        try:
            result = distributed_train_function(*args, **kwargs)
        except Exception:
            session.failed()
            raise
        session.step += 1
        return result

    def save_checkpoint_if_preempted(self, *args: Any, **kwargs: Any) -> None:
        """TensorFlow's alternative to ``run()``: call it after each step of your own."""
        session = self._session
        session.step += 1
        session.at_boundary(step=session.step)

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """TensorFlow's scope for ``save_checkpoint_if_preempted`` (and TPUs); here a step
        that raises inside it tells the tracker and the run record."""
        try:
            yield
        except Exception:
            self._session.failed()
            raise

    def close(self) -> None:
        """The loop is over (TensorFlow's handler has no such call; ``with handler:`` makes
        it): a stop that came during the last step is acted on (save, exit); else the last
        step is committed, so that a stop in the code after the loop, which no ``run()`` will
        see, leaves a checkpoint a rerun resumes from with nothing left to train. Then the
        signal handlers are restored and the directory released; safe to call twice."""
        session = self._session
        if self._open and not session.stopped:
            self._open = False
            try:
                if not session.at_boundary(Phase.END, step=session.step):
                    session.finished(always=True)
            finally:
                session.close()
        else:
            self._open = False
            session.close()

    def __enter__(self) -> PreemptionCheckpointHandler:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, Exception):  # a step raised: nothing to commit
            self._open = False
            self._session.failed()
        self.close()

    # -- saving ----------------------------------------------------------------------------
    def _write(self, tmp: Path, step: int, context: Any) -> None:
        tmp.mkdir()
        self._calls.assign(step)
        self._saved.write(str(tmp / PREFIX))

    def _load(self, path: Path) -> int:
        if not (path / f"{PREFIX}.index").is_file():
            raise ValueError(f"{path} holds no {PREFIX}.index")
        _build_optimizers(self.checkpoint)
        self._saved.read(str(path / PREFIX)).expect_partial()
        return int(self._calls.numpy())
