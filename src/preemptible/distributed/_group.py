"""torch.distributed as preemptible uses it: the ranks and the process group's key-value store.

Why a store and not a collective: a signal or a notice reaches one rank, or the ranks at
different moments. A rank that stops alone leaves the others blocked in their next collective;
a stop flag all-reduced at every step costs a collective and a device sync per step. So every
multi-rank step of preemptible (the stop agreement, a save, a resume) goes through the c10d
store of ``init_process_group``: rank 0 announces a result under a key, the others wait for it
with a deadline (``PREEMPTIBLE_DIST_TIMEOUT``), and a rank that died fails the others' waits
instead of hanging them.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import io
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._env import env_float
from .._errors import AgreementError, CheckpointSaveError, ConfigError
from .._torch import initialized_dist

logger = logging.getLogger("preemptible")

DEFAULT_TIMEOUT = 600.0
"""Seconds a rank waits for the others (acknowledgements, a save, a resume) before it fails."""

DEFAULT_POLL = 0.05
"""Seconds between two looks of the poller at the store (20 small requests a second per rank)."""

KEY_ROOT = "preemptible"
_handlers = itertools.count()  # one key namespace per handler, in creation order on every rank


def torch_module(name: str) -> Any:
    """A torch module, typed loosely (torch's own stubs do not export what is used here)."""
    return importlib.import_module(name)


# -- the process group -------------------------------------------------------------------------


def dist_timeout() -> float:
    """``PREEMPTIBLE_DIST_TIMEOUT``: seconds a rank waits for the others."""
    timeout = env_float("PREEMPTIBLE_DIST_TIMEOUT", DEFAULT_TIMEOUT, strict_min=True)
    assert timeout is not None
    return timeout


def process_group() -> tuple[int, int] | None:
    """(rank, world size) of the initialized default group with more than one rank; None when
    not distributed. Never imports torch: no torch, no process group."""
    dist = initialized_dist()
    try:
        if dist is None:
            return None
        world = int(dist.get_world_size())
        return (int(dist.get_rank()), world) if world > 1 else None
    except Exception:  # pragma: no cover - a half-initialized or destroyed group
        return None


def default_store() -> Any:
    """The key-value store of the default process group.

    torch has no documented accessor. ``ProcessGroup.get_group_store()`` (a public name on the
    group object) is tried first, then the private ``distributed_c10d._get_default_store()``;
    tests/unit/test_agreement.py fails loudly when either moves in the pinned torch. Without
    both, the ranks meet in a store of their own at MASTER_ADDR:MASTER_PORT+1.
    """
    dist = torch_module("torch.distributed")
    group = dist.group.WORLD
    getter = getattr(group, "get_group_store", None)
    if getter is not None:
        try:
            return getter()
        except Exception as exc:
            logger.debug("preemptible: ProcessGroup.get_group_store() failed: %r", exc)
    private = getattr(
        torch_module("torch.distributed.distributed_c10d"), "_get_default_store", None
    )
    if private is not None:
        try:
            return private()
        except Exception as exc:
            logger.debug("preemptible: _get_default_store() failed: %r", exc)
    rank, world = int(dist.get_rank()), int(dist.get_world_size())
    logger.warning(
        "preemptible: this torch gives no access to the process group's store; the ranks "
        "meet in a store of their own at MASTER_ADDR:MASTER_PORT+1"
    )
    return fallback_store(rank, world)


def fallback_store(
    rank: int,
    world: int,
    *,
    host: str | None = None,
    port: int | None = None,
    timeout: float = 300.0,
) -> Any:
    """A TCPStore served by rank 0 at ``host``:``port`` (default MASTER_ADDR, MASTER_PORT + 1)."""
    dist = torch_module("torch.distributed")
    if host is None:
        host = os.environ.get("MASTER_ADDR") or None
    if port is None:
        raw = os.environ.get("MASTER_PORT", "")
        if not raw.isdecimal() or not 0 < int(raw) < 65535:
            raise ConfigError(
                f"MASTER_PORT={raw!r} is not valid; preemptible's fallback store listens on "
                "MASTER_PORT + 1, so set MASTER_PORT to a port number below 65535"
            )
        port = int(raw) + 1
    if host is None:
        raise ConfigError(
            "MASTER_ADDR is not set; preemptible's fallback store needs the address of rank 0"
        )
    return dist.TCPStore(
        host,
        port,
        world,
        rank == 0,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )


@dataclass
class Ranks:
    """The process group as preemptible uses it: who we are, and a store namespaced for one
    handler, with the waits every multi-rank step needs (bounded by ``timeout``)."""

    rank: int
    world: int
    store: Any
    timeout: float = DEFAULT_TIMEOUT
    seq: int = 0  # multi-rank steps (saves, resumes) so far: every rank takes them in order

    @classmethod
    def detect(cls) -> Ranks | None:
        """The current process group with a fresh namespace, or None when not distributed."""
        found = process_group()
        if found is None:
            return None
        dist = torch_module("torch.distributed")
        prefix = f"{KEY_ROOT}/{next(_handlers)}/"
        return cls(found[0], found[1], dist.PrefixStore(prefix, default_store()), dist_timeout())

    @classmethod
    def over(cls, store: Any, rank: int, world: int) -> Ranks:
        """Ranks that meet in ``store`` (any store with ``set``, ``get``, ``check``,
        ``compare_set`` and ``delete_key``: the process group of a framework other than torch),
        waiting ``PREEMPTIBLE_DIST_TIMEOUT`` seconds for each other."""
        return cls(rank, world, store, dist_timeout())

    @staticmethod
    def default_timeout() -> float:
        """``PREEMPTIBLE_DIST_TIMEOUT``: seconds a rank waits for the others."""
        return dist_timeout()

    def next_key(self, what: str) -> str:
        """A fresh key for the next multi-rank step; the same on every rank."""
        self.seq += 1
        return f"{what}/{self.seq}"

    def leave_together(self) -> None:
        """After a committed stop: rank 0 finishes its record and tracker before any rank
        exits, so that a launcher that tears the job down when the first rank exits (torchrun)
        cannot cut rank 0 short."""
        try:
            if self.is_zero:
                self.store.set("stop/exit", "1")
            else:
                self.wait_any(["stop/exit"], "rank 0 to finish its stop")
        except Exception as exc:  # the stop is committed; leaving is all that is left
            logger.warning("preemptible: leaving without rank 0: %s", exc)

    @property
    def is_zero(self) -> bool:
        return self.rank == 0

    def wait_any(self, keys: Sequence[str], what: str) -> str:
        """The first of ``keys`` that exists; AgreementError after ``timeout`` seconds."""
        return self._wait(keys, what, every=False)

    def wait_all(self, keys: Sequence[str], what: str) -> None:
        self._wait(keys, what, every=True)

    def _wait(self, keys: Sequence[str], what: str, *, every: bool) -> str:
        # Polled rather than store.wait(): a long wait would hold the store client that the
        # agreement's poller shares, and a poll can give up on a deadline of its own.
        deadline = time.monotonic() + self.timeout
        pause = 0.001
        left = list(keys)
        while True:
            for key in list(left):
                if self.store.check([key]):
                    if not every:
                        return key
                    left.remove(key)
            if not left:
                return keys[-1]
            if time.monotonic() > deadline:
                raise AgreementError(
                    f"rank {self.rank} waited {self.timeout:g} s for {what}; is every rank "
                    "alive? (PREEMPTIBLE_DIST_TIMEOUT sets the wait)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def get_json(self, key: str) -> Any:
        return json.loads(bytes(self.store.get(key)).decode())

    def set_json(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def gather(self, key: str, data: bytes, what: str) -> list[bytes] | None:
        """Every rank's ``data`` on rank 0 (in rank order), None elsewhere."""
        self.store.set(f"{key}/{self.rank}", data)
        if not self.is_zero:
            return None
        keys = [f"{key}/{r}" for r in range(self.world)]
        self.wait_all(keys, what)
        out = [bytes(self.store.get(k)) for k in keys]
        for k in keys:
            self.store.delete_key(k)
        return out

    def announce(self, key: str, fields: dict[str, Any]) -> None:
        """Rank 0's result of a step the others wait for (a path, or an error)."""
        self.set_json(key, fields)

    def hear(self, key: str, what: str) -> dict[str, Any]:
        self.wait_any([key], what)
        value = self.get_json(key)
        return value if isinstance(value, dict) else {}


# -- per-rank RNG states ----------------------------------------------------------------------


def pack(value: Any) -> bytes:
    """Plain containers and tensors as bytes that load with ``weights_only=True``."""
    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def save_failed(ranks: Ranks, key: str, exc: BaseException) -> None:
    """Tell the waiting ranks that rank 0's save failed (best effort: the store may be gone)."""
    with contextlib.suppress(Exception):  # the store may be gone: nobody left to tell
        ranks.announce(key, {"error": f"{type(exc).__name__}: {exc}"})


def hear_written(ranks: Ranks, key: str, directory: Path) -> None:
    """Rank 0, before it commits a sharded checkpoint: wait until every other rank has written
    its part into ``directory``; a rank's failure fails the save."""
    for r in range(1, ranks.world):
        heard = ranks.hear(f"{key}/written/{r}", "every rank to write its shards")
        if "error" in heard:
            raise CheckpointSaveError(f"rank {r}: {heard['error']}", directory)


def remote_error(fields: Mapping[str, Any], what: str, path: Path) -> CheckpointSaveError:
    return CheckpointSaveError(f"rank 0 could not {what}: {fields.get('error')}", path)


def run_on_zero(ranks: Ranks, key: str, what: str, fn: Callable[[], dict[str, Any]]) -> Any:
    """Rank 0 runs ``fn`` and announces its result (or its failure) under ``key``; the others
    wait for it. Returns the announced fields on every rank; a failure raises on every rank."""
    if ranks.is_zero:
        try:
            fields = fn()
        except BaseException as exc:
            save_failed(ranks, key, exc)
            raise
        ranks.announce(key, fields)
        return fields
    return ranks.hear(key, what)
