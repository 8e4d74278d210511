"""``PreemptionCallback``: the Keras 3 front end of the kit."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras

from ..frontend import (
    CheckpointStore,
    ConfigError,
    NamedSaver,
    Periodic,
    Phase,
    StopSession,
    TerminationConfig,
    checkpoint_directory,
    normalize_signals,
    saving_config,
)
from ..trackers import Tracker
from ._state import (
    Checkpoint,
    Holdings,
    Position,
    Rng,
    capture_rng,
    custom_train_step,
    find_holdings,
    read_checkpoint,
    restore_metrics,
    restore_rng,
    restore_variables,
    write_checkpoint,
)

logger = logging.getLogger("preemptible")

NAME = "keras-{step}.npz"
BACKENDS = ("torch", "tensorflow", "jax")


@dataclass(frozen=True)
class _Moment:
    """What a save records besides the variables. ``rng``: the random states of the batch end
    to record (None: as they are at the save). ``finished``: the fit trained to its end."""

    rng: Rng | None = None
    finished: bool = False


_NOW = _Moment()
_FINISHED = _Moment(finished=True)


class PreemptionCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Stop ``model.fit()`` after a batch on a signal or a platform notice, commit a checkpoint
    in ``checkpoint_dir`` and exit; the same ``fit()`` run again resumes at that batch.

    ::

        keras.utils.set_random_seed(0)
        model.fit(x, y, epochs=10, callbacks=[PreemptionCallback("ckpt/")])

    On the first signal of ``signals`` (default INT, TERM, HUP, USR1, USR2) or a notice of
    ``termination_config`` (default: the detected platform's), the current batch finishes,
    ``keras-<step>.npz`` is committed (weights, optimizer and metric variables, the states of
    the layers' ``SeedGenerator``s, the global random states of Python, NumPy and torch, the
    epoch and the batch within it; every other Keras optimizer the model holds in an attribute,
    as a GAN's ``self.d_optimizer``, and the objects of ``state``) and the process exits with
    128 + signum (143 for a notice). A second signal exits at once with code 1. A notice with
    time to spare commits an insurance checkpoint and training goes on to the last batch the
    grace policy allows.
    ``save_every_steps`` (batches, or "auto") or ``save_every_seconds``: periodic checkpoints
    (against a SIGKILL); the newest ``keep`` are kept. ``tracker``: uploads the final
    checkpoint and is finalized once, as for ``PreemptionCheckpointHandler``.

    At ``on_train_begin`` the newest checkpoint that loads is restored, and the fit continues
    at the saved batch of the saved epoch: the batches before it in that epoch are drawn from
    the data (so that the shuffle is the same) but not trained on. The fit then ends with the
    same weights, bit for bit, as a fit never stopped (CPU; ``keras.utils.set_random_seed``
    called before the model is built). A fit whose model holds state the checkpoint would miss
    (an attribute holding a NumPy or torch generator, a torch module, a TensorFlow variable)
    is refused at its start, naming it. ``state``: more Keras objects to save and restore
    (optimizers, layers, metrics, seed generators, variables), by name. ``checkpoint_dir``
    None: the supervisor's ``PREEMPTIBLE_CHECKPOINT_DIR``. Backends: torch, TensorFlow and JAX
    (whose layers draw from their ``SeedGenerator``s, saved with the model);
    ``steps_per_execution=1``.
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        *,
        termination_config: TerminationConfig | None = None,
        signals: Iterable[int | str] | None = None,
        keep: int = 2,
        save_every_steps: int | str | None = None,
        save_every_seconds: float | None = None,
        tracker: Tracker | None = None,
        state: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.state = dict(state or {})
        self._holdings = Holdings({}, {})
        self.termination_config = saving_config(
            termination_config,
            "the Keras PreemptionCallback (it saves the model, optimizer and random states itself)",
        )
        self.signals = normalize_signals(signals)
        self.store = CheckpointStore(checkpoint_directory(checkpoint_dir), keep=keep)
        self.periodic = Periodic.of(save_every_steps, save_every_seconds)
        self.tracker = tracker
        self._session: StopSession | None = None
        self._original: Callable[..., Any] | None = None  # the fit's own train_function
        self._resume: Checkpoint | None = None  # restored, its epoch not begun yet
        self._metrics: Checkpoint | None = None  # its metrics, once the model has built them
        self._skip = 0  # batches of the resumed epoch still to draw without training
        self._ignore = 0  # their on_train_batch_end calls still to come
        self._step = 0  # batches trained in all
        self._epoch = 0
        self._batch = 0  # batches done in the current epoch
        self._epoch_rng: Rng | None = None
        self._batch_rng: Rng | None = None  # the resumed batch end's, once the skip is done
        self._last_rng: Rng | None = None  # at the end of an epoch's last batch
        self._batch_started = 0.0
        self._in_fit = False

    @property
    def checkpoint_dir(self) -> Path:
        return self.store.directory

    @property
    def step(self) -> int:
        """Batches trained in all (restored by a resume)."""
        return self._step

    @property
    def resume_path(self) -> Path | None:
        """The checkpoint the current (or last) fit resumed from, if any."""
        return self._session.resume_path if self._session is not None else None

    # -- hooks -----------------------------------------------------------------------------
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        model = self.model
        backend = keras.backend.backend()
        if backend not in BACKENDS:
            raise ConfigError(
                f"the Keras backend {backend!r} is not supported by PreemptionCallback; use "
                "KERAS_BACKEND=torch, KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax"
            )
        if model.steps_per_execution != 1:
            raise ConfigError(
                f"steps_per_execution={model.steps_per_execution} is not supported by "
                "PreemptionCallback (it stops and resumes between two batches); compile with "
                "steps_per_execution=1"
            )
        if self._session is not None:  # a fit after one whose SystemExit was caught
            self._session.close()
        self._holdings = find_holdings(model, self.state)  # ConfigError: state it cannot save
        if not custom_train_step(model) and not model.optimizer.built:
            # fit's own step applies it to the trainable variables: its slot variables exist
            # from here, restorable. A custom train_step's optimizers (and the default one a
            # GAN's compile() makes and never steps) are built by their first step, or by a
            # resume for the variables they were saved for.
            model.optimizer.build(model.trainable_variables)
        self._step = self._epoch = self._batch = self._skip = self._ignore = 0
        self._resume = self._metrics = None
        self._epoch_rng = self._batch_rng = self._last_rng = None
        saver = NamedSaver(self.store, NAME, self._write, load=self._load)
        session = StopSession(
            saver,
            termination_config=self.termination_config,
            signals=self.signals,
            tracker=self.tracker,
            periodic=self.periodic,
            before_exit=self._unwind,
        )
        self._session = session
        session.start()
        try:
            session.begin()  # the newest checkpoint that loads: _load
        except BaseException:
            session.close()
            raise
        self._in_fit = True
        self._original = model.train_function
        model.train_function = self._train_function
        resumed = self._resume
        if resumed is not None:
            at = resumed.position
            # fit() reads the epoch to start from after on_train_begin (BackupAndRestore's
            # way; canary-tested)
            model._initial_epoch = self.params["epochs"] if at.finished else at.epoch
            self._skip = self._ignore = 0 if at.finished else at.batch

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch, self._batch = epoch, 0
        resumed = self._resume
        if resumed is not None and epoch == resumed.position.epoch:
            self._resume = None
            # fit reset the metrics just before; TensorFlow builds compiled metrics at the
            # first step, so they may not exist yet: then at the first skipped batch
            if not restore_metrics(self.model, resumed) and self._skip:
                self._metrics = resumed
            # the epoch's data draws its order (a torch sampler's seed, Python's shuffle of a
            # PyDataset) at its first batch: from the epoch's start states
            restore_rng(resumed.epoch_rng)
            if self._skip == 0:
                restore_rng(resumed.batch_rng)
            else:
                self._batch_rng = resumed.batch_rng
        self._epoch_rng = capture_rng()

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._batch_started = time.monotonic()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._batch = batch + 1
        if self._ignore:  # a batch of the resumed epoch that was trained before the stop
            self._ignore -= 1
            if not self._ignore and self._batch == self.params.get("steps"):
                self._last_rng = self._batch_rng  # a stop in the validation after it
            return
        self._step += 1
        session = self._session
        if session is None or session.stopped:
            return
        seconds = time.monotonic() - self._batch_started
        if session.at_boundary(Phase.STEP, step=self._step, context=_NOW, seconds=seconds):
            return
        if self._batch == self.params.get("steps"):  # a validation may follow: its stop
            self._last_rng = capture_rng()  # records this batch end

    def on_test_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._batch_started = time.monotonic()

    def on_test_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # A validation batch of the fit: a stop need not wait for the whole pass. The
        # checkpoint records the epoch's last batch; the resumed fit runs the validation again.
        session, rng = self._session, self._last_rng
        if session is None or session.stopped or not self._in_fit:
            return
        session.at_boundary(
            Phase.EVALUATION,
            step=self._step,
            context=_Moment(rng=rng),
            seconds=time.monotonic() - self._batch_started,
            act=rng is not None,
        )

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._last_rng = None

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        session = self._session
        self._restore_fit()
        if session is None or session.stopped:
            return
        try:
            # a stop that came after the last batch (the last epoch's end, its validation)
            if session.at_boundary(Phase.END, step=self._step, context=_FINISHED):
                return
            session.finished(step=self._step, context=_FINISHED, tell_tracker=False)
        finally:
            session.close()

    # -- the train function: skips the batches done, tells the kit about a failure ---------
    def _train_function(self, *args: Any) -> Any:
        """torch and TensorFlow call it with the data; JAX with (state, data) and takes
        (logs, state) back: the fit's variables live in that state for the whole epoch."""
        original = self._original
        assert original is not None
        if self._skip:
            self._skip -= 1
            data = args[-1]
            # TensorFlow and JAX hand over the iterator (draw the batch), torch the batches
            batch = next(data) if hasattr(data, "__next__") else data[0]
            if self._metrics is not None:
                self._build_metrics(batch, self._metrics)
                self._metrics = None
            if self._skip == 0 and self._batch_rng is not None:
                restore_rng(self._batch_rng)  # as the stopped fit left them at its last batch
            if len(args) == 2:  # JAX: the state goes back as it came
                return self._jax_metrics(args[0]), args[0]
            return self.model.get_metrics_result()
        try:
            return original(*args)
        except BaseException:
            self._abandon()
            raise

    def _jax_metrics(self, state: Any) -> Any:
        """The logs of a skipped batch on JAX: the metric values of ``state`` (the model's
        own metric variables are emptied while the epoch runs)."""
        model = self.model
        values = list(zip(model.metrics_variables, state[-1], strict=True))
        with keras.StatelessScope(state_mapping=values):
            return model.get_metrics_result()

    def _build_metrics(self, batch: Any, resumed: Checkpoint) -> None:
        """Build the compiled metrics on a batch (an inference pass: no random draw), then
        put the saved values in."""
        model = self.model
        x, y, weight = keras.utils.unpack_x_y_sample_weight(batch)
        model.compute_metrics(x, y, model(x, training=False), sample_weight=weight)
        if not restore_metrics(model, resumed):
            logger.info(
                "preemptible: the metrics of epoch %d are logged from batch %d on (its "
                "metric variables are not those saved)",
                resumed.position.epoch,
                resumed.position.batch,
            )

    def _restore_fit(self) -> None:
        """Give the model back its own train function and start epoch."""
        self._in_fit = False
        model = self.model
        if self._original is not None:
            model.train_function = self._original
            self._original = None
        if model is not None:
            model._initial_epoch = None

    def _abandon(self) -> None:
        """A training step raised: the tracker is told, the handlers are put back."""
        session = self._session
        self._restore_fit()
        if session is not None and not session.stopped:
            session.failed()
            session.close()

    def _unwind(self) -> None:
        """Just before the stop's exit (or an ``exit_fn`` that returns: the fit ends)."""
        self.model.stop_training = True
        self._restore_fit()

    # -- saving ----------------------------------------------------------------------------
    def _write(self, tmp: Path, step: int, moment: _Moment | None) -> None:
        moment = moment or _NOW
        if keras.backend.backend() == "jax":
            # JAX's fit keeps the variables' values in its own state while an epoch runs and
            # empties the variables: put the values back in them (fit reads them again)
            self.model.jax_state_sync()
        epoch_rng = self._epoch_rng
        batch_rng = moment.rng or capture_rng()
        position = Position(step, self._epoch, self._batch, finished=moment.finished)
        write_checkpoint(
            tmp, self.model, self._holdings, position, epoch_rng or batch_rng, batch_rng
        )

    def _load(self, path: Path) -> int:
        # checked whole before anything is set
        checkpoint = read_checkpoint(path, self.model, self._holdings)
        restore_variables(self.model, self._holdings, checkpoint)
        self._resume = checkpoint
        self._step = checkpoint.position.step
        return checkpoint.position.step


__all__ = ["PreemptionCallback"]
