"""The workers of a ``MultiWorkerMirroredStrategy`` as the kit's ``Ranks``, meeting in
TensorFlow's coordination service.

The stop agreement (``preemptible.distributed._agreement``) needs a key-value store every
worker reaches, with ``set``, ``get``, ``check``, ``compare_set`` (the first writer wins) and
``delete_key``. Under torch.distributed that is the process group's c10d store. A
``MultiWorkerMirroredStrategy`` has one too: the coordination service that its chief hosts and
every worker's runtime is connected to, the very store TensorFlow's own
``PreemptionCheckpointHandler`` agrees in. Its Python face is private
(``context.context().set_config_key_value``, ``get_config_key_value``,
``delete_config_key_value``); ``tests/unit/test_tf_coordination.py`` fails loudly when those
names move in the installed TensorFlow.

What the service gives and what the agreement needs:

- insert fails with ``AlreadyExistsError`` when the key exists: that is ``compare_set(key,
  "", value)`` (the first writer wins, the others read the winner's value). ``set`` of a key
  that exists deletes it first (the agreement and ``Ranks`` write each key once; deleting a key
  in the service deletes the keys under ``key/`` too, which none of them overwrites);
- a get waits up to a timeout for the key, and the timeout covers the RPC too: ``check`` is a
  get with a 20 ms timeout (one RPC to the chief, as a c10d ``check`` is one to its server;
  the call releases the GIL, so the agreement's poller waiting in it costs the training thread
  nothing). On a loaded machine an RPC can outlast it and a key that exists reads as missing;
  so a key once seen is remembered (the agreement never deletes one): when the poller has seen
  a round and raised the flag, the training thread's own look finds it too. A miss elsewhere
  only delays an acknowledgement by one poll. ``get`` waits up to the ranks' timeout.

Keys live under ``preemptible/<n>/`` (one namespace per handler, made in the same order on
every worker), apart from TensorFlow's own.

``WorkersSaver``: the workers resume together, from the checkpoint the chief chose.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, cast

import tensorflow as tf
from tensorflow.python.eager import context

from ..frontend import (
    Checkpoint,
    CheckpointLoadError,
    NamedSaver,
    Ranks,
    Saved,
)

KEY_ROOT = "preemptible"
CHECK_MS = 20  # how long a check waits for a key (and its RPC)
_handlers = itertools.count()  # one key namespace per handler, in creation order on every worker


class CoordinationStore:
    """TensorFlow's coordination service as the store the kit's agreement speaks to (see the
    module docstring). Values are text (the kit writes JSON and decimal numbers)."""

    def __init__(self, prefix: str, timeout: float) -> None:
        self.prefix = prefix
        self.timeout_ms = max(1, int(timeout * 1000))
        self._context = context.context()
        self._seen: set[str] = set()  # keys known to exist (see the module docstring)

    def _key(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value: str | bytes) -> None:
        text = _text(value)
        try:
            self._context.set_config_key_value(self._key(key), text)
        except tf.errors.AlreadyExistsError:
            self._context.delete_config_key_value(self._key(key))
            self._context.set_config_key_value(self._key(key), text)
        self._seen.add(key)

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it up to the ranks' timeout."""
        value: str = self._context.get_config_key_value(self._key(key), self.timeout_ms)
        return value.encode()

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` exists now."""
        for key in keys:
            if key in self._seen:
                continue
            try:
                self._context.get_config_key_value(self._key(key), CHECK_MS)
            except tf.errors.DeadlineExceededError:
                return False
            self._seen.add(key)
        return True

    def compare_set(self, key: str, expected: str, value: str | bytes) -> bytes:
        """Insert ``value`` unless ``key`` exists (``expected`` must be "": the only form the
        agreement uses); the value the key holds afterwards, the first writer's."""
        if expected != "":
            raise ValueError("the coordination service compares with an absent key only")
        self._seen.add(key)
        try:
            self._context.set_config_key_value(self._key(key), _text(value))
        except tf.errors.AlreadyExistsError:
            return self.get(key)
        return _text(value).encode()

    def delete_key(self, key: str) -> bool:
        self._seen.discard(key)
        self._context.delete_config_key_value(self._key(key))
        return True


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def task_of(cluster_resolver: Any) -> tuple[int, int]:
    """(rank, number of workers) of this task in ``cluster_resolver``'s cluster: the chief is
    rank 0 (with no ``chief`` job, worker 0 is the chief, as for TensorFlow), the workers follow
    in order. (0, 1) without a resolver."""
    if cluster_resolver is None:
        return 0, 1
    spec = cluster_resolver.cluster_spec().as_dict()
    chiefs = len(spec.get("chief", []))
    world = chiefs + len(spec.get("worker", []))
    if world <= 1:
        return 0, 1
    task_type, task_id = cluster_resolver.task_type, int(cluster_resolver.task_id or 0)
    if task_type == "chief":
        return 0, world
    if task_type != "worker":
        raise ValueError(
            f"task type {task_type!r} of cluster_resolver is not valid; the handler runs on "
            "the chief and the workers of a MultiWorkerMirroredStrategy (TF_CONFIG's task)"
        )
    return chiefs + task_id, world


def workers_of(cluster_resolver: Any) -> Ranks | None:
    """This worker among the workers of ``cluster_resolver`` as the kit's ``Ranks``, over the
    coordination service (a fresh namespace); None for one worker."""
    rank, world = task_of(cluster_resolver)
    if world == 1:
        return None
    store = CoordinationStore(f"{KEY_ROOT}/{next(_handlers)}/", Ranks.default_timeout())
    return Ranks.over(store, rank, world)


class WorkersSaver(NamedSaver):
    """The handler's ``NamedSaver`` (every worker writes, the chief's is committed) with one
    resume for all workers: the chief chooses the newest committed checkpoint and tells the
    others before any worker reads it, and every worker reads that one. Reading is
    collective under a strategy (building an optimizer's variables broadcasts them), so
    workers that read different checkpoints, or one that reads none, would wait for each
    other in collectives that never match. A checkpoint that does not load fails the resume
    on every worker (no older one is tried: the others could not follow)."""

    def resume(self, hint: Path | None) -> Saved | None:
        ranks, load, pattern = self.ranks, self._load, self.pattern
        if ranks is None or load is None or pattern is None:
            return super().resume(hint)
        key = ranks.next_key("resume")
        if ranks.is_zero:
            found = self.store.committed(pattern=pattern)
            match = pattern.match(hint.name) if hint is not None else None
            if match:
                found.append(Checkpoint(int(match.group(1)), cast(Path, hint)))
            newest = max(found, key=lambda c: c.step, default=None)
            where = None if newest is None else str(newest.path.resolve())
            ranks.announce(key, {"path": where})
        else:
            where = ranks.hear(key, "the chief to choose the checkpoint").get("path")
        if where is None:
            return None
        path = Path(where)
        if not path.is_dir():
            raise CheckpointLoadError(
                f"worker {ranks.rank}: the chief resumes from {path}, which this worker does "
                "not see; checkpoint_dir must be one directory every worker reads (a shared "
                "file system) or a bucket's URL",
                path,
            )
        try:
            step = load(path)
        except Exception as exc:
            raise CheckpointLoadError(
                f"worker {ranks.rank}: {path} does not load: {type(exc).__name__}: {exc}", path
            ) from exc
        self.last = (step, path)
        return self.last
