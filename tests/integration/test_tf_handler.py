"""``preemptible.tensorflow.PreemptionCheckpointHandler``: a custom TensorFlow loop written
after TensorFlow's handler docs (``tests/scripts/tf_loop.py``: a ``tf.function`` step under a
``MultiWorkerMirroredStrategy`` of one worker, ``tf.train.Checkpoint``, noise from TensorFlow's
global generator), ported by changing one import, stopped by real signals in its own process.
A stop must exit with the configured code and leave a committed ``tf-<N>`` directory; the
same command run again must resume at step N and end with every model and optimizer variable
equal, bit for bit, to a loop never stopped (one reference run, shared).

Two workers (``TF_CONFIG`` on localhost, the strategy's own gRPC and coordination service): a
signal to one worker stops both at the same step, every worker exits with the same code, the
chief's checkpoint is the one committed, and a SIGKILL of one worker leaves the last periodic
checkpoint, which both resume from; the end equals a two-worker loop never stopped.
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

from tests.conftest import Child, python_args
from tests.support.checkpoints import committed, temporaries
from tests.support.reference import DIR, References, free_port

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


def same_arrays(a: Path, b: Path) -> bool:
    with np.load(a) as want, np.load(b) as got:
        return want.files == got.files and all(np.array_equal(want[k], got[k]) for k in want.files)


def workers(spawn, d: Path, *extra: str) -> list[Child]:
    """Two workers of ``tf_loop.py`` (its TF_CONFIG from RANK and RANK_PORTS, as the shared
    reference of ``ranks=2`` starts them)."""
    ports = ",".join(str(free_port()) for _ in range(2))
    env = {"WORLD_SIZE": "2", "RANK_PORTS": ports, "OMP_NUM_THREADS": "1"}
    return [spawn(loop_args(d, *extra), env={**env, "RANK": str(r)}) for r in range(2)]


def newest(d: Path) -> int:
    return max(int(name.removeprefix("tf-")) for name in committed(d, "tf-*"))


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


def test_a_signal_to_one_of_two_workers_stops_both_at_the_same_step(
    reference_runs: References, tmp_path: Path, spawn
) -> None:
    reference_runs.start(loop_args(Path(DIR)), ranks=2)
    ckpt = tmp_path / "ckpt"
    # 1. SIGTERM to the chief only: both stop after the same step, both exit 143.
    first = workers(spawn, tmp_path, "--step-sleep", "0.1")
    first[0].wait_line(lambda line: steps([line]) == [3], 120)
    first[0].signal(signal.SIGTERM)
    assert [w.wait(60) for w in first] == [143, 143], "\n---\n".join(w.output for w in first)
    done = max(steps(first[0].lines))
    assert max(steps(first[1].lines)) == done
    assert committed(ckpt, "tf-*") == [f"tf-{done}"]  # the chief's; the other's went away
    assert f"rank 1: stopped at step {done} on SIGTERM" in first[1].output
    # 2. Resumed there by both; SIGTERM to worker 1 only; the chief saves every 4 steps too.
    second = workers(spawn, tmp_path, "--step-sleep", "0.1", "--save-every-steps", "4")
    second[1].wait_line(lambda line: steps([line]) == [done + 3], 120)
    second[1].signal(signal.SIGTERM)
    assert [w.wait(60) for w in second] == [143, 143], "\n---\n".join(w.output for w in second)
    for rank, w in enumerate(second):
        assert f"rank {rank}: resumed from {ckpt / f'tf-{done}'} at step {done}" in w.output
        assert steps(w.lines)[0] == done + 1
    done = max(steps(second[1].lines))
    assert max(steps(second[0].lines)) == done and newest(ckpt) == done
    assert f"rank 0: stopped at step {done} on SIGTERM" in second[0].output
    # 3. SIGKILL of the chief, the coordination service's host, between periodic saves; a
    # scheduler then ends the other worker. Both resume from the last periodic checkpoint.
    third = workers(spawn, tmp_path, "--step-sleep", "0.1", "--save-every-steps", "4")
    at = (done // 4 + 1) * 4 + 1  # one step past a periodic save
    third[0].wait_line(lambda line: steps([line]) == [at], 120)
    third[0].signal(signal.SIGKILL)
    third[1].kill()
    assert third[0].wait(30) == -signal.SIGKILL
    periodic = newest(ckpt)
    assert periodic % 4 == 0 and at - 1 <= periodic <= max(steps(third[0].lines))
    # 4. To the end: the same variables, bit for bit, on both, as two workers never stopped.
    last = workers(spawn, tmp_path)
    assert [w.wait(120) for w in last] == [0, 0], "\n---\n".join(w.output for w in last)
    assert f"resumed from {ckpt / f'tf-{periodic}'} at step {periodic}" in last[1].output
    assert steps(last[1].lines)[0] == periodic + 1 and "done it=18" in last[1].lines
    assert temporaries(ckpt) == [] and not list(tmp_path.glob("workertemp*"))
    reference = reference_runs.result(loop_args(Path(DIR)), ranks=2) / "out.npz"
    assert same_arrays(reference, tmp_path / "out.npz")
    assert same_arrays(reference, tmp_path / "out-1.npz")


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
