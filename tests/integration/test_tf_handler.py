"""``preemptible.tensorflow.PreemptionCheckpointHandler``: a custom TensorFlow loop written
after TensorFlow's handler docs (``tests/scripts/tf_loop.py``: a ``tf.function`` step under a
``MultiWorkerMirroredStrategy`` of one worker, ``tf.train.Checkpoint``, noise from TensorFlow's
global generator), ported by changing one import, stopped by real signals in its own process.
A stop must exit with the configured code and leave a committed ``tf-<N>`` directory; the
same command run again must resume at step N and end with every model and optimizer variable
equal, bit for bit, to a loop never stopped (one reference run, shared).
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import python_args
from tests.support.checkpoints import committed, temporaries
from tests.support.reference import DIR, References

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        importlib.util.find_spec("tensorflow") is None, reason="tensorflow not installed"
    ),
]

STEP = re.compile(r"^step (\d+) ")


def loop_args(d: Path, *extra: str) -> list[str]:
    return python_args("tf_loop.py", "--dir", str(d / "ckpt"), "--out", str(d / "out.npz"), *extra)


def steps(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := STEP.match(line))]


def test_a_tf_docs_loop_stops_and_resumes_exactly(
    reference_runs: References, tmp_path: Path, spawn
) -> None:
    reference_runs.start(loop_args(Path(DIR)))
    # 1. TensorFlow's own TerminationConfig, its exit_fn taking no argument: exit 42.
    first = spawn(loop_args(tmp_path, "--step-sleep", "0.1", "--exit-42"))
    first.wait_line(lambda line: STEP.match(line) is not None and steps([line]) == [4], 120)
    first.signal(signal.SIGTERM)
    assert first.wait(60) == 42, first.output
    # one format for every line of the stop, though TensorFlow's checkpoint writer (absl)
    # configured the root logger as it saved
    stop = [line for line in first.lines if "preemptible" in line]
    assert stop and all(line.startswith("preemptible: ") for line in stop), stop
    done = max(steps(first.lines))
    [name] = committed(tmp_path / "ckpt", "tf-*")
    assert name == f"tf-{done}"
    assert sorted(p.name for p in (tmp_path / "ckpt" / name).iterdir()) == [
        "ckpt.data-00000-of-00001",
        "ckpt.index",
    ]
    # 2. Resumed there (no step replayed: the check is before the step, as TensorFlow's);
    # SIGUSR1 later: 128 + 10.
    second = spawn(loop_args(tmp_path, "--step-sleep", "0.1"))
    second.wait_line(lambda line: steps([line]) == [done + 5], 120)
    second.signal(signal.SIGUSR1)
    assert second.wait(60) == 138, second.output
    assert f"resumed from {tmp_path / 'ckpt' / name} at step {done}" in second.output
    assert steps(second.lines)[0] == done + 1
    done = max(steps(second.lines))
    assert f"tf-{done}" in committed(tmp_path / "ckpt", "tf-*")
    assert temporaries(tmp_path / "ckpt") == []
    # 3. To the end: every variable as the loop never stopped.
    last = spawn(loop_args(tmp_path))
    assert last.wait(120) == 0, last.output
    assert steps(last.lines)[0] == done + 1 and "done it=18" in last.lines
    assert "tf-18" in committed(tmp_path / "ckpt", "tf-*")  # close(): the end committed
    reference = reference_runs.result(loop_args(Path(DIR))) / "out.npz"
    with np.load(reference) as want, np.load(tmp_path / "out.npz") as got:
        assert want.files == got.files
        assert all(np.array_equal(want[k], got[k]) for k in want.files)


ARGUMENTS = """
import json, os, sys
os.environ["KERAS_BACKEND"] = "tensorflow"
import tensorflow as tf
from preemptible.frontend import ConfigError
from preemptible.tensorflow import PreemptionCheckpointHandler

checkpoint = tf.train.Checkpoint(v=tf.Variable(1.0))
config = tf.distribute.experimental.TerminationConfig(save_fn=lambda: None)
said = []
two = tf.distribute.cluster_resolver.SimpleClusterResolver(
    tf.train.ClusterSpec({"worker": ["localhost:1", "localhost:2"]})
)
for args, kwargs in [
    ((None, checkpoint), {}),
    ((None, object(), "ckpt"), {}),
    ((two, checkpoint, "ckpt"), {}),
    ((None, checkpoint, "ckpt"), {"termination_config": config}),
    ((None, checkpoint, "ckpt"), {"exit_code": 256}),
]:
    try:
        PreemptionCheckpointHandler(*args, **kwargs).close()
        said.append(None)
    except ConfigError as exc:
        said.append(str(exc))
print(json.dumps(said))
"""


def test_bad_arguments_say_what_is_valid(tmp_path: Path, spawn) -> None:
    child = spawn([sys.executable, "-c", ARGUMENTS], cwd=tmp_path)
    assert child.wait(120) == 0, child.output
    said = json.loads(child.lines[-1])
    assert "checkpoint_dir is required with a tf.train.Checkpoint" in said[0]
    assert "use a tf.train.Checkpoint or a tf.train.CheckpointManager" in said[1]
    assert "task type None of cluster_resolver is not valid" in said[2]
    assert "termination_config.save_fn is not used by the TensorFlow" in said[3]
    assert "exit_code=256 is not valid" in said[4]
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("tf-*"))
