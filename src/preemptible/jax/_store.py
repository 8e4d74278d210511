"""The processes of ``jax.distributed`` as the kit's ranks: a key-value store over JAX's
coordination service.

Why this store: the kit's stop agreement (``StopAgreement``) makes every process stop at the
same step with no collective per step; it needs a key-value store that every process reaches
(torch.distributed's is its c10d store). A JAX job has one already: ``jax.distributed.
initialize`` connects every process to the coordination service of process 0, whose key-value
API Orbax and JAX's own preemption sync point use too. JAX does not export that client, so it
is read from ``jax._src.distributed.global_state.client`` (a private name:
tests/unit/test_jax_store.py fails loudly when it, or a method used here, moves in the pinned
jax). Its set never compares; an insert that refuses an existing key is the "first writer
wins" that ``compare_set(key, "", value)`` means.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax

from ..frontend import Ranks

KEY_ROOT = "preemptible/jax"
_loops = itertools.count()  # one key namespace per loop, in creation order on every process


def coordination_client() -> Any | None:
    """JAX's coordination service client, or None when ``jax.distributed`` is not initialized."""
    from jax._src import distributed

    return distributed.global_state.client


def _status_is(exc: BaseException, status: str) -> bool:
    return str(exc).startswith(status)


class CoordinationStore:
    """What the kit's ranks need of a store (``set``, ``get``, ``check``, ``compare_set``,
    ``delete_key``) over JAX's coordination service, under ``prefix``. ``get`` waits up to
    ``timeout`` seconds for a key that is not there yet, as a c10d store does."""

    def __init__(self, client: Any, prefix: str, *, timeout: float) -> None:
        self.client = client
        self.prefix = prefix
        self.timeout_ms = max(1, int(timeout * 1000))

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.client.key_value_set_bytes(self.prefix + key, data, allow_overwrite=True)

    def get(self, key: str) -> bytes:
        return bytes(self.client.blocking_key_value_get_bytes(self.prefix + key, self.timeout_ms))

    def check(self, keys: Sequence[str]) -> bool:
        for key in keys:
            try:
                self.client.key_value_try_get_bytes(self.prefix + key)
            except Exception as exc:
                if _status_is(exc, "NOT_FOUND"):
                    return False
                raise  # the service is gone: the caller's waits fail, its poller ends
        return True

    def compare_set(self, key: str, expected: str, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` unless it exists; return its value either way (only
        ``expected=""``, "not set yet", is supported: all the agreement asks)."""
        if expected != "":
            raise ValueError("CoordinationStore.compare_set compares with '' (not set) only")
        data = desired.encode() if isinstance(desired, str) else bytes(desired)
        try:
            self.client.key_value_set_bytes(self.prefix + key, data, allow_overwrite=False)
        except Exception as exc:
            if not _status_is(exc, "ALREADY_EXISTS"):
                raise
            return bytes(self.client.key_value_try_get_bytes(self.prefix + key))
        return data

    def delete_key(self, key: str) -> bool:
        self.client.key_value_delete(self.prefix + key)
        return True


def jax_ranks() -> Ranks | None:
    """The processes of ``jax.distributed`` as ranks, with a fresh key namespace; None when
    there is one process (or ``jax.distributed`` is not initialized)."""
    if jax.process_count() < 2:
        return None
    client = coordination_client()
    if client is None:
        return None
    prefix = f"{KEY_ROOT}/{next(_loops)}/"
    return Ranks.over(
        CoordinationStore(client, prefix, timeout=Ranks.default_timeout()),
        jax.process_index(),
        jax.process_count(),
    )
