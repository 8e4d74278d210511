"""``preemptible.keras.PreemptionCallback`` in the test process (torch backend): the Keras
internals it relies on (``test_keras_canary_*``: a failure means Keras moved; read the new
release and adapt ``preemptible/keras``), bad arguments, checkpoints that do not load.

Stops, resumes and the TensorFlow backend are in ``tests/integration/test_keras_stops.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported
keras = pytest.importorskip("keras")
np = pytest.importorskip("numpy")

from preemptible.frontend import CheckpointLoadError, ConfigError  # noqa: E402
from preemptible.keras import PreemptionCallback  # noqa: E402

X = np.random.RandomState(0).randn(24, 3).astype("float32")
Y = X.sum(1, keepdims=True)


def tiny(**compile_kw: Any) -> Any:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dropout(0.5), keras.layers.Dense(1)]
    )
    model.compile(optimizer="adam", loss="mse", **compile_kw)
    return model


class Recorder(keras.callbacks.Callback):
    """Records the epochs begun; wraps ``train_function`` to record what each call gets."""

    def __init__(self, initial_epoch: int | None = None, reseed: bool = False) -> None:
        super().__init__()
        self.initial_epoch = initial_epoch
        self.reseed = reseed
        self.epochs: list[int] = []
        self.calls: list[Any] = []

    def on_train_begin(self, logs: Any = None) -> None:
        if self.initial_epoch is not None:
            self.model._initial_epoch = self.initial_epoch
        original = self.model.train_function

        def counted(data: Any) -> Any:
            self.calls.append(data)
            return original(data)

        self.model.train_function = counted

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epochs.append(epoch)
        if self.reseed:
            import torch

            torch.manual_seed(5)


def test_keras_canary_the_version_is_the_pinned_one() -> None:
    assert keras.__version__ == "3.15.1", "constraints.txt pins keras==3.15.1: re-run these"


def test_keras_canary_fit_reads_initial_epoch_after_on_train_begin() -> None:
    model = tiny()
    assert model._initial_epoch is None
    recorder = Recorder(initial_epoch=2)
    model.fit(X, Y, batch_size=8, epochs=3, callbacks=[recorder], verbose=0)
    assert recorder.epochs == [2]


def test_keras_canary_fit_calls_the_models_train_function_once_per_batch() -> None:
    model = tiny()
    recorder = Recorder()
    model.fit(X, Y, batch_size=8, epochs=2, callbacks=[recorder], verbose=0)
    assert len(recorder.calls) == 6
    data = recorder.calls[0]  # torch: the batches drawn (TensorFlow: the iterator)
    assert isinstance(data, list) and len(data) == 1 and not hasattr(data, "__next__")


def test_keras_canary_an_epochs_order_is_drawn_after_on_epoch_begin() -> None:
    """The same torch RNG state at every on_epoch_begin: every epoch has the same order."""
    model = tiny()
    recorder = Recorder(reseed=True)
    model.fit(X, Y, batch_size=8, epochs=2, shuffle=True, callbacks=[recorder], verbose=0)
    firsts = [np.asarray(call[0][0]) for call in recorder.calls]
    assert np.array_equal(np.concatenate(firsts[:3]), np.concatenate(firsts[3:]))
    assert not np.array_equal(np.concatenate(firsts[:3]), X)  # shuffled


def test_keras_canary_an_optimizer_keeps_the_variables_it_was_built_for() -> None:
    # a resume builds a custom train_step's optimizer for the same variables, found by path
    from preemptible.keras._state import built_for, custom_train_step

    model = tiny()
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables[::-1])
    assert [id(v) for v in built_for(optimizer)] == [id(v) for v in model.trainable_variables[::-1]]
    assert not custom_train_step(model)


JAX_CANARY = """
import keras, numpy as np
assert keras.backend.backend() == "jax"
x = np.ones((24, 3), "float32")
model = keras.Sequential([keras.Input((3,)), keras.layers.Dropout(0.5), keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse", metrics=["mae"])
seen = []

class Probe(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        original = self.model.train_function

        def step(state, iterator):  # JAX: (state, iterator) in, (logs, state) out
            assert hasattr(iterator, "__next__")  # the callback draws a skipped batch from it
            logs, new = original(state, iterator)
            assert len(new) == 4  # trainable, non-trainable, optimizer and metrics variables
            metrics = list(zip(self._model.metrics_variables, new[-1]))
            with keras.StatelessScope(state_mapping=metrics):  # the metrics of a state
                result = self._model.get_metrics_result()
            seen.append(sorted(result))
            return logs, new

        self.model.train_function = step

    def on_train_batch_end(self, batch, logs=None):
        model = self._model  # not .model: that syncs on JAX
        state = model._jax_state["trainable_variables"][0]
        assert not model._jax_state_synced
        model.jax_state_sync()  # a save's: the variables take the state's values
        assert np.array_equal(np.asarray(model.trainable_variables[0].value), np.asarray(state))

model.fit(x, x[:, :1], batch_size=8, epochs=1, callbacks=[Probe()], verbose=0)
assert seen == [["loss", "mae"]] * 3, seen
print("canary ok")
"""


def test_keras_canary_jax_fit_keeps_the_variables_in_its_state_mid_epoch() -> None:
    """On JAX the callback's skipped batches take and give back fit's state, read the metrics
    from it, and a save syncs the variables first (``jax_state_sync``)."""
    pytest.importorskip("jax")
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    done = subprocess.run(
        [sys.executable, "-c", JAX_CANARY], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "canary ok" in done.stdout, done.stdout + done.stderr


def test_state_the_checkpoint_would_miss_is_refused_naming_it(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    model = tiny()
    model.rng = np.random.default_rng(0)
    cb = PreemptionCallback(tmp_path)
    cb.set_model(model)
    with pytest.raises(ConfigError, match=r"the model's attribute 'rng' is a numpy\.random"):
        cb.on_train_begin()
    del model.rng
    cb = PreemptionCallback(tmp_path, state={"noise": np.random.default_rng(0)})
    cb.set_model(model)
    with pytest.raises(ConfigError, match=r"state='noise' is a numpy\.random.*takes Keras"):
        cb.on_train_begin()
    assert signal.getsignal(signal.SIGTERM) is before


def test_objects_given_in_state_are_saved_and_restored(tmp_path: Path) -> None:
    from preemptible.keras._state import (
        Position,
        capture_rng,
        find_holdings,
        read_checkpoint,
        restore_variables,
        write_checkpoint,
    )

    model = tiny()
    scale, other = keras.Variable(2.0), keras.optimizers.SGD(0.1)
    other.build(model.trainable_variables)
    other.iterations.assign(3)
    holdings = find_holdings(model, {"scale": scale, "other": other})
    rng = capture_rng()
    write_checkpoint(tmp_path / "c.npz", model, holdings, Position(3, 0, 3), rng, rng)
    scale.assign(5.0)
    other.iterations.assign(0)
    checkpoint = read_checkpoint(tmp_path / "c.npz", model, holdings)
    assert set(checkpoint.groups) == {"state:scale", "optimizer:other"}  # model.optimizer: unused
    restore_variables(model, holdings, checkpoint)
    assert float(keras.ops.convert_to_numpy(scale)) == 2.0
    assert int(keras.ops.convert_to_numpy(other.iterations)) == 3


def test_bad_arguments_say_what_is_valid(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"keep=0 is not valid; use an integer >= 1"):
        PreemptionCallback(tmp_path, keep=0)
    with pytest.raises(ConfigError, match="NOPE"):
        PreemptionCallback(tmp_path, signals=["NOPE"])
    with pytest.raises(ConfigError, match="save_every_steps=0 is not valid"):
        PreemptionCallback(tmp_path, save_every_steps=0)


def test_steps_per_execution_above_1_is_refused_and_the_handlers_stay_as_they_were(
    tmp_path: Path,
) -> None:
    # (the torch backend refuses it itself before fit() begins; TensorFlow runs it)
    before = signal.getsignal(signal.SIGTERM)
    model = tiny()
    model.steps_per_execution = 2
    cb = PreemptionCallback(tmp_path)
    cb.set_model(model)
    with pytest.raises(ConfigError, match="steps_per_execution=1"):
        cb.on_train_begin()
    assert signal.getsignal(signal.SIGTERM) is before
    assert list(tmp_path.glob("keras-*.npz")) == []


def test_a_torn_newer_checkpoint_is_set_aside_and_one_of_another_model_refused(
    tmp_path: Path,
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    model = tiny()
    cb = PreemptionCallback(tmp_path, save_every_steps=2, keep=5)
    model.fit(X, Y, batch_size=8, epochs=1, callbacks=[cb], verbose=0)
    assert sorted(p.name for p in tmp_path.glob("keras-*.npz")) == ["keras-2.npz", "keras-3.npz"]
    (tmp_path / "keras-9.npz").write_bytes(b"PK\x03\x04 torn")
    again = tiny()
    cb = PreemptionCallback(tmp_path)
    again.fit(X, Y, batch_size=8, epochs=1, callbacks=[cb], verbose=0)
    assert cb.resume_path == tmp_path / "keras-3.npz"  # the end of that fit: nothing to train
    assert (tmp_path / "keras-9.npz.unloadable").exists()
    saved = [keras.ops.convert_to_numpy(v) for v in model.variables]
    assert all(
        np.array_equal(a, keras.ops.convert_to_numpy(b))
        for a, b in zip(saved, again.variables, strict=True)
    )

    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    other.compile(optimizer="adam", loss="mse")
    with pytest.raises(CheckpointLoadError, match="model variables, this model has"):
        other.fit(X, Y, batch_size=8, callbacks=[PreemptionCallback(tmp_path)], verbose=0)
    assert signal.getsignal(signal.SIGTERM) is before


class SignalAt(keras.callbacks.Callback):
    """Sends SIGTERM to this process as training batch ``batch`` of ``epoch`` begins (None:
    the epoch's first validation batch)."""

    def __init__(self, epoch: int, batch: int | None) -> None:
        super().__init__()
        self.epoch, self.batch = epoch, batch
        self.current = -1
        self.sent = False

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current = epoch

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self.batch == batch:
            self._send()

    def on_test_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self.batch is None:
            self._send()

    def _send(self) -> None:
        if self.current == self.epoch and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def values(model: Any) -> list[Any]:
    return [keras.ops.convert_to_numpy(v) for v in [*model.variables, *model.optimizer.variables]]


@pytest.mark.parametrize(
    ("batch", "saved"),
    [(1, "keras-5.npz"), (None, "keras-6.npz")],  # mid-epoch; in validation: the epoch's end
    ids=["mid-epoch", "validation"],
)
def test_a_stop_in_process_resumes_exactly(batch: int | None, saved: str, tmp_path: Path) -> None:
    """The stop's exit_fn returns (fit() then ends), the fit is run again with a new model:
    its variables end equal to an uninterrupted fit's. Epoch 1 has 3 batches."""
    from preemptible.frontend import TerminationConfig

    fit = dict(x=X, y=Y, batch_size=8, epochs=3, shuffle=True, verbose=0)
    fit["validation_data"] = (X[:16], Y[:16])
    fit["validation_batch_size"] = 4
    reference = tiny()
    reference.fit(**fit)

    codes: list[int] = []  # an exit_fn that returns: fit() ends after the stop
    config = TerminationConfig(termination_watcher_fn=lambda: False, exit_fn=codes.append)
    stopped = tiny()
    watcher = SignalAt(epoch=1, batch=batch)
    cb = PreemptionCallback(tmp_path, termination_config=config)
    stopped.fit(**fit, callbacks=[watcher, cb])
    assert codes == [143]
    assert [p.name for p in tmp_path.glob("keras-*.npz")] == [saved]

    resumed = tiny()
    cb = PreemptionCallback(tmp_path, termination_config=config)
    resumed.fit(**fit, callbacks=[cb])
    assert cb.resume_path == tmp_path / saved and codes == [143]
    assert all(
        np.array_equal(a, b) for a, b in zip(values(reference), values(resumed), strict=True)
    )
