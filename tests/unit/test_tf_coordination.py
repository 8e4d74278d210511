"""Canary for the private TensorFlow names the workers' stop agreement relies on, and the
workers as ranks.

``preemptible.tensorflow``'s workers agree on a stop in TensorFlow's coordination service
through ``context.context()``'s ``set_config_key_value`` / ``get_config_key_value(key,
timeout_in_ms)`` / ``delete_config_key_value`` (the calls TensorFlow's own
``PreemptionCheckpointHandler`` makes). They are no public API: a failure here names what moved
in the installed TensorFlow; read its failure_handling.py, adapt
src/preemptible/tensorflow/_coordination.py, then this file.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="tensorflow not installed"
)


def test_the_coordination_service_key_value_calls_exist() -> None:
    import tensorflow as tf
    from tensorflow.python.eager import context

    ctx = context.context()
    for name in ("set_config_key_value", "get_config_key_value", "delete_config_key_value"):
        assert callable(getattr(ctx, name, None)), f"TensorFlow moved Context.{name}"
    get = inspect.signature(ctx.get_config_key_value)
    assert list(get.parameters)[:2] == ["key", "timeout_in_ms"], (
        f"TensorFlow changed Context.get_config_key_value{get}: the store's check waits with it"
    )
    assert list(inspect.signature(ctx.set_config_key_value).parameters) == ["key", "value"], (
        "TensorFlow changed Context.set_config_key_value (insert, failing on a key that exists)"
    )
    # what the store catches: an insert of a key that exists, a get that timed out
    assert issubclass(tf.errors.AlreadyExistsError, tf.errors.OpError)
    assert issubclass(tf.errors.DeadlineExceededError, tf.errors.OpError)
    # TensorFlow's own handler still agrees through these very calls
    from tensorflow.python.distribute.failure_handling import failure_handling

    source = inspect.getsource(failure_handling)
    for name in ("set_config_key_value", "get_config_key_value"):
        assert f"context.context().{name}(" in source, (
            f"TensorFlow's PreemptionCheckpointHandler no longer calls {name}: check whether "
            "the coordination service's key-value API moved"
        )


def test_workers_are_ranks_chief_first() -> None:
    import tensorflow as tf

    from preemptible.tensorflow._coordination import task_of

    def resolver(cluster: dict[str, list[str]], task_type: str | None, task_id: int) -> object:
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type=task_type, task_id=task_id
        )

    two = {"worker": ["localhost:1", "localhost:2"]}
    assert task_of(None) == (0, 1)
    assert task_of(resolver({"worker": ["localhost:1"]}, "worker", 0)) == (0, 1)
    assert task_of(resolver(two, "worker", 0)) == (0, 2)
    assert task_of(resolver(two, "worker", 1)) == (1, 2)
    with_chief = {"chief": ["localhost:0"], **two}
    assert task_of(resolver(with_chief, "chief", 0)) == (0, 3)
    assert task_of(resolver(with_chief, "worker", 0)) == (1, 3)
    with pytest.raises(ValueError, match="task type 'ps' of cluster_resolver is not valid"):
        task_of(resolver({**two, "ps": ["localhost:3"]}, "ps", 0))
