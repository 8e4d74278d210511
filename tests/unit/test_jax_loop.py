"""``preemptible.jax.PreemptibleLoop`` in the test process: what it saves at the loop's end and
restores into new objects, the checkpoints it refuses, bad arguments. Stops by real signals,
and two processes, are in tests/integration/test_jax.py.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")
np = pytest.importorskip("numpy")

from preemptible.frontend import CheckpointLoadError, ConfigError  # noqa: E402
from preemptible.jax import PreemptibleLoop  # noqa: E402
from tests.support.checkpoints import committed  # noqa: E402

X = np.random.RandomState(0).randn(8, 3).astype("float32")


class Tiny(nnx.Module):  # type: ignore[misc]
    def __init__(self, width: int, rngs: Any) -> None:
        self.linear = nnx.Linear(3, width, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return self.dropout(self.linear(x))


def make(width: int = 4) -> tuple[Any, Any]:
    model = Tiny(width, nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


@nnx.jit  # type: ignore[misc]
def train_step(model: Any, optimizer: Any, x: Any) -> None:
    grads = nnx.grad(lambda m: (m(x) ** 2).mean())(model)
    optimizer.update(model, grads)


def arrays(*objects: Any) -> list[Any]:
    leaves = jax.tree.leaves(nnx.state(objects))
    return [
        np.asarray(
            jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v
        )
        for v in leaves
    ]


def train(directory: Path, model: Any, optimizer: Any) -> PreemptibleLoop:
    loop = PreemptibleLoop(directory, state={"model": model, "optimizer": optimizer})
    for _epoch in loop.epochs(2):
        for x in loop.batches([X[:4], X[4:]]):
            train_step(model, optimizer, x)
    return loop


def test_the_end_is_committed_and_restored_into_new_objects(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    model, optimizer = make()
    loop = train(tmp_path, model, optimizer)
    assert loop.step == 4 and signal.getsignal(signal.SIGTERM) == before
    assert committed(tmp_path, "checkpoint-*") == ["checkpoint-4"]
    assert sorted(p.name for p in (tmp_path / "checkpoint-4").iterdir()) == [
        "preemptible-0.json",
        "state",
    ]
    again, again_optimizer = make()
    assert any(not np.array_equal(a, b) for a, b in zip(arrays(again), arrays(model), strict=True))
    resumed = train(tmp_path, again, again_optimizer)  # nothing left to train
    assert resumed.resume_path == tmp_path / "checkpoint-4" and resumed.step == 4
    restored, trained = arrays(again, again_optimizer), arrays(model, optimizer)
    assert all(np.array_equal(a, b) for a, b in zip(restored, trained, strict=True))
    assert int(again_optimizer.step[...]) == 4


def test_a_checkpoint_of_another_model_is_refused_and_a_torn_newer_one_set_aside(
    tmp_path: Path,
) -> None:
    train(tmp_path, *make())
    shutil.copytree(tmp_path / "checkpoint-4", tmp_path / "checkpoint-9")
    shutil.rmtree(tmp_path / "checkpoint-9" / "state")  # torn: no Orbax state
    model, optimizer = make()
    loop = PreemptibleLoop(tmp_path, state={"model": model, "optimizer": optimizer})
    assert loop.resume_path == tmp_path / "checkpoint-4"
    assert (tmp_path / "checkpoint-9.unloadable").is_dir()
    loop.session.close()

    before = signal.getsignal(signal.SIGTERM)
    wide, wide_optimizer = make(width=5)
    with pytest.raises(CheckpointLoadError):
        PreemptibleLoop(tmp_path, state={"model": wide, "optimizer": wide_optimizer})
    assert signal.getsignal(signal.SIGTERM) == before


def shuffled(directory: Path, stop_after_epoch: int | None = None) -> list[Any]:
    """Three epochs shuffled by NumPy's global generator; SIGTERM during an epoch's evaluation
    (after its last batch) when asked: the stop is acted on at the epoch's end."""
    from preemptible.frontend import TerminationConfig

    np.random.seed(0)
    model, optimizer = make()
    config = TerminationConfig(termination_watcher_fn=lambda: False, exit_fn=lambda code: None)
    state = {"model": model, "optimizer": optimizer}
    loop = PreemptibleLoop(directory, state=state, termination_config=config)
    for epoch in loop.epochs(3):
        order = np.random.permutation(len(X))
        for x in loop.batches([X[order[:4]], X[order[4:]]]):
            train_step(model, optimizer, x)
        if epoch == stop_after_epoch:
            os.kill(os.getpid(), signal.SIGTERM)
    return arrays(model, optimizer)


def test_a_stop_at_an_epochs_end_resumes_with_the_next_epochs_shuffle(tmp_path: Path) -> None:
    never_stopped = shuffled(tmp_path / "a")
    stopped = shuffled(tmp_path / "b", stop_after_epoch=0)
    assert committed(tmp_path / "b", "checkpoint-*") == ["checkpoint-2"]
    assert any(not np.array_equal(a, b) for a, b in zip(stopped, never_stopped, strict=True))
    resumed = shuffled(tmp_path / "b")
    assert all(np.array_equal(a, b) for a, b in zip(resumed, never_stopped, strict=True))


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (None, "give the NNX objects to save by name"),
        ({"model": np.zeros(3)}, "state='model' is a numpy.ndarray; state= takes Flax NNX"),
        ({"a/b": nnx.Rngs(0)}, "names must be non-empty strings without '/'"),
    ],
)
def test_bad_state_says_what_is_valid(state: Any, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        PreemptibleLoop(tmp_path, state=state)


def test_a_checkpoint_manager_is_refused_naming_what_is_valid(tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    model, _ = make()
    manager = ocp.CheckpointManager(tmp_path / "orbax")
    with pytest.raises(ConfigError, match="checkpointer=CheckpointManager is not valid; give"):
        PreemptibleLoop(tmp_path / "ckpt", state={"model": model}, checkpointer=manager)
    manager.close()
