"""torch.distributed: every rank stops at the same step, and the ranks' checkpoints agree.

Why a store and not a collective: a signal or a notice reaches one rank, or the ranks at
different moments. A rank that stops alone leaves the others blocked in their next collective;
a stop flag all-reduced at every step costs a collective and a device sync per step. Instead,
the rank that learns of a stop *proposes a round* in the process group's key-value store (the
c10d store of ``init_process_group``), and a daemon thread on every rank polls the store for
it. While nothing is pending, a step boundary costs two attribute writes and two truth tests.

The agreement (``StopAgreement``). Rounds are numbered; round ``n`` is a key whose value (the
first writer wins, ``compare_set``) says what it is: an insurance checkpoint or a stop (with
the signal or notice that started it). Every rank acknowledges round ``n`` with the first
boundary at which it can still act, and all act at the same boundary: the maximum of the
acknowledgements. The poller acknowledges for its rank even while the training thread is
blocked in a collective, so waiting for the acknowledgements never deadlocks, however far the
ranks are apart (ranks that do a collective every step are at most one step apart; ranks that
accumulate gradients without one may be further). The training thread publishes where it is in
one integer, ``2 * boundary`` on arriving and ``2 * boundary + 1`` once past it, and reads the
flag after each write; the poller sets the flag and then reads the integer (Dekker's order), so
an acknowledgement never claims a boundary the rank has already passed.

The checkpoints. Default (full state): at the agreed step every rank puts its RNG states in the
store, rank 0 writes one file with all of them (and its own state; under DDP the model and
optimizer are the same on every rank) and publishes the result; the others wait for it, which
is the one barrier of a save. Sharded (``sharded=True``, or DTensor parameters such as FSDP2):
every rank writes its shards with ``torch.distributed.checkpoint`` into one temporary directory
chosen by rank 0, which adds the small state and renames the directory into place once every
rank has written: the commit protocol of a file. In the background (``async_save=True``) the
same directory is written by DCP's ``async_save`` (``BackgroundShards``), and the "written" and
"done" messages go through the store from the ranks' background threads.
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
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._env import env_float
from .._errors import CheckpointLoadError, CheckpointSaveError, ConfigError, PreemptibleError
from ..stop._controller import Decision
from ..stop._latch import signal_name
from ..stop._termination import Notice

logger = logging.getLogger("preemptible")

DEFAULT_TIMEOUT = 600.0
"""Seconds a rank waits for the others (acknowledgements, a save, a resume) before it fails."""

DEFAULT_POLL = 0.05
"""Seconds between two looks of the poller at the store (20 small requests a second per rank)."""

KEY_ROOT = "preemptible"
_handlers = itertools.count()  # one key namespace per handler, in creation order on every rank


def _module(name: str) -> Any:
    """A torch module, typed loosely (torch's own stubs do not export what is used here)."""
    return importlib.import_module(name)


class AgreementError(PreemptibleError):
    """The ranks could not agree (one did not answer in time, or one passed the agreed step)."""


# -- the process group -------------------------------------------------------------------------


def dist_timeout() -> float:
    """``PREEMPTIBLE_DIST_TIMEOUT``: seconds a rank waits for the others."""
    timeout = env_float("PREEMPTIBLE_DIST_TIMEOUT", DEFAULT_TIMEOUT, strict_min=True)
    assert timeout is not None
    return timeout


def process_group() -> tuple[int, int] | None:
    """(rank, world size) of the initialized default group with more than one rank; None when
    not distributed. Never imports torch: no torch, no process group."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
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
    dist = _module("torch.distributed")
    group = dist.group.WORLD
    getter = getattr(group, "get_group_store", None)
    if getter is not None:
        try:
            return getter()
        except Exception as exc:
            logger.debug("preemptible: ProcessGroup.get_group_store() failed: %r", exc)
    private = getattr(_module("torch.distributed.distributed_c10d"), "_get_default_store", None)
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
    dist = _module("torch.distributed")
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

    @classmethod
    def detect(cls) -> Ranks | None:
        """The current process group with a fresh namespace, or None when not distributed."""
        found = process_group()
        if found is None:
            return None
        dist = _module("torch.distributed")
        prefix = f"{KEY_ROOT}/{next(_handlers)}/"
        return cls(found[0], found[1], dist.PrefixStore(prefix, default_store()), dist_timeout())

    def agreement(self) -> StopAgreement:
        poll = env_float("PREEMPTIBLE_DIST_POLL", DEFAULT_POLL, strict_min=True)
        assert poll is not None
        return StopAgreement(
            self.store, self.rank, self.world, poll_interval=poll, timeout=self.timeout
        )

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


# -- the agreement -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Agreed:
    """What every rank does at this boundary; ``notice`` is the stop's (for STOP);
    ``periodic``: an INSURANCE that is rank 0's periodic save (it may be written in the
    background), not a checkpoint a grace window asked for."""

    decision: Decision
    notice: Notice | None = None
    periodic: bool = False


CONTINUE = Agreed(Decision.CONTINUE)


class StopAgreement:
    """All ranks act on a stop or an insurance checkpoint at the same boundary.

    Front ends call ``quiet()`` at every boundary (True: nothing pending anywhere, this rank
    passes it) and ``decide()`` when it is False or when the rank itself has something to ask
    for. ``decide()`` returns what to do here; after INSURANCE (the save is done) the front end
    calls it again at the same boundary. The store only needs ``set``, ``get``, ``check``,
    ``compare_set`` and ``delete_key`` (any c10d store; a HashStore in the unit tests).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        *,
        poll_interval: float = DEFAULT_POLL,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.ranks = Ranks(rank, world, store, timeout)
        self.rank, self.world = rank, world
        self._store = store
        self._poll_interval = poll_interval
        self._flag = False  # a round is open here: the one thing the fast path reads
        self._boundary = 0  # boundaries passed so far
        self._pos = 0  # 2 * boundary on arriving, + 1 once past it
        self._round = 0  # the round this rank acts on next
        self._acked = 0  # rounds 0 .. _acked - 1 are acknowledged by this rank
        self._own_ack: dict[int, int] = {}
        self._kind: dict[str, Any] | None = None  # round _round, once known
        self._act_at: int | None = None  # its boundary, once every rank acknowledged
        self._stopped = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="preemptible-agree", daemon=True)
        self._thread.start()

    @property
    def boundary(self) -> int:
        """Boundaries passed so far (one per ``quiet()``/``decide()`` that let the rank on)."""
        return self._boundary

    @property
    def pending(self) -> bool:
        return self._flag

    def close(self) -> None:
        self._done.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._poll_interval + 1)

    def open_stop(self) -> Notice | None:
        """The stop some rank proposed and this one has not acted on (None if none): for a
        front end whose ranks meet once more after their last boundary (the end of a fit)."""
        with self._lock:
            n = self._round
            while True:
                key = _round_key(n)
                if not self._store.check([key]):
                    return None
                kind = _parse_kind(self._store.get(key))
                if kind.get("kind") == "stop":
                    return _notice_of(kind)
                n += 1

    # -- the fast path ---------------------------------------------------------------------
    def quiet(self) -> bool:
        """At a boundary: True when no round is open (this rank passes the boundary)."""
        b = self._boundary
        self._pos = 2 * b
        if self._flag:
            return False
        self._pos = 2 * b + 1
        if self._flag:  # the poller saw a round between the two reads: stay at b
            self._pos = 2 * b
            return False
        self._boundary = b + 1
        return True

    # -- the slow path ---------------------------------------------------------------------
    def decide(
        self, local: Decision, notice: Notice | None = None, *, periodic: bool = False
    ) -> Agreed:
        """What every rank does at this boundary. ``local``: what this rank's own requests
        ask for (its controller's decision); ``notice``: its stop request, for the others;
        ``periodic``: its INSURANCE is a periodic save."""
        with self._lock:
            if self._stopped:
                raise AgreementError("this rank already stopped; the agreement is over")
            b = self._boundary
            self._pos = 2 * b
            kind = self._open_round(local, notice, periodic)
            if kind is None:
                return self._pass(b)
            n = self._round
            if self._acked <= n:
                self._ack(n, b)
            if self._act_at is None and b >= self._own_ack[n]:
                self._act_at = self._agreed_boundary(n)
            if self._act_at is None or self._act_at > b:
                return self._pass(b)
            if self._act_at < b:
                raise AgreementError(
                    f"rank {self.rank} is at step boundary {b}, past the agreed {self._act_at}"
                )
            if kind.get("kind") == "stop":
                self._stopped = True
                self._done.set()
                return Agreed(Decision.STOP, _notice_of(kind))
            self._next_round()
            return Agreed(Decision.INSURANCE, periodic=kind.get("kind") == "periodic")

    def _open_round(
        self, local: Decision, notice: Notice | None, periodic: bool
    ) -> dict[str, Any] | None:
        """The current round's kind: known, found in the store, or proposed now."""
        if self._kind is not None:
            return self._kind
        key = _round_key(self._round)
        if self._store.check([key]):
            self._kind = _parse_kind(self._store.get(key))
        elif local is not Decision.CONTINUE:
            what = "periodic" if periodic else "insurance"
            mine: dict[str, Any] = {
                "kind": "stop" if local is Decision.STOP else what,
                "rank": self.rank,
            }
            if notice is not None:
                mine.update(source=notice.source, signum=notice.signum)
            self._kind = _parse_kind(self._store.compare_set(key, "", json.dumps(mine)))
            self._flag = True
        if self._kind is not None:
            self._flag = True
        return self._kind

    def _ack(self, n: int, value: int) -> None:
        self._store.set(f"{_round_key(n)}/ack/{self.rank}", str(value))
        self._own_ack[n] = value
        self._acked = n + 1

    def _agreed_boundary(self, n: int) -> int:
        """The round's boundary: the maximum of every rank's acknowledgement (waits for them;
        each poller acknowledges on its own, so the wait ends within a poll interval or two)."""
        keys = [f"{_round_key(n)}/ack/{r}" for r in range(self.world)]
        self.ranks.wait_all(keys, f"every rank to acknowledge round {n}")
        return max(int(bytes(self._store.get(k))) for k in keys)

    def _pass(self, b: int) -> Agreed:
        self._pos = 2 * b + 1
        self._boundary = b + 1
        return CONTINUE

    def _next_round(self) -> None:
        self._round += 1
        self._kind = None
        self._act_at = None
        self._flag = self._acked > self._round  # the poller saw the next one already

    # -- the poller ------------------------------------------------------------------------
    def _poll(self) -> None:
        while not self._done.wait(self._poll_interval):
            try:
                n = self._acked
                if not self._store.check([_round_key(n)]):
                    continue
                with self._lock:
                    if self._acked != n or self._stopped:
                        continue
                    self._flag = True  # before reading the position: see the module docstring
                    pos = self._pos
                    self._ack(n, (pos + 1) // 2)
            except Exception as exc:  # the store went away: the group is being torn down
                logger.debug("preemptible: agreement poller ends: %r", exc)
                return


def _round_key(n: int) -> str:
    return f"round/{n}"


def _parse_kind(raw: Any) -> dict[str, Any]:
    try:
        value = json.loads(bytes(raw).decode())
    except (ValueError, UnicodeDecodeError):
        value = None
    if not isinstance(value, dict) or value.get("kind") not in ("stop", "insurance", "periodic"):
        raise AgreementError(f"the store holds an unknown round: {bytes(raw)[:100]!r}")
    return value


def _notice_of(kind: Mapping[str, Any]) -> Notice:
    signum = kind.get("signum")
    source = kind.get("source")
    return Notice(
        source=str(source) if source else (signal_name(signum) if signum else "stop"),
        signum=signum if isinstance(signum, int) else None,
        detail=f"agreed by all ranks; first asked for by rank {kind.get('rank')}",
    )


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


def own_rng(payload: Mapping[str, Any], rank: int, path: Path) -> dict[str, Any]:
    """The payload with this rank's RNG states in ``rng`` (what ``apply_payload`` restores).

    A checkpoint of fewer ranks leaves the extra ranks' streams as they are (warned); one
    written without a process group gives every rank its single set of states."""
    ranks = payload.get("rng_ranks")
    out = dict(payload)
    if isinstance(ranks, list):
        if rank < len(ranks):
            out["rng"] = ranks[rank]
        else:
            out["rng"] = {}
            logger.warning(
                "preemptible: %s holds random states for %d ranks; rank %d keeps its own",
                path,
                len(ranks),
                rank,
            )
    return out


# -- sharded checkpoints -----------------------------------------------------------------------

META_NAME = "preemptible.pt"
"""Rank 0's part of a sharded checkpoint: step, small objects, plain values, RNG of every rank."""


def has_dtensor(objects: Mapping[str, Any]) -> bool:
    """Whether any module of ``objects`` has DTensor parameters (FSDP2, tensor parallel)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    for obj in objects.values():
        if isinstance(obj, torch.nn.Module) and any(
            isinstance(p, DTensor) for p in obj.parameters()
        ):
            return True
    return False


def split_sharded(objects: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(modules and optimizers, written by every rank; everything else, written by rank 0)."""
    import torch

    big = {
        k: v for k, v in objects.items() if isinstance(v, torch.nn.Module | torch.optim.Optimizer)
    }
    small = {k: v for k, v in objects.items() if k not in big}
    modules = [k for k, v in big.items() if isinstance(v, torch.nn.Module)]
    if len(modules) != 1 and len(big) > len(modules):
        raise ConfigError(
            f"a sharded checkpoint of an optimizer needs exactly one module in state (found "
            f"{len(modules)}: {', '.join(modules) or 'none'}); wrap the models in one "
            "torch.nn.ModuleDict"
        )
    return big, small


def sharded_state(big: Mapping[str, Any]) -> dict[str, Any]:
    """The state dicts of modules and optimizers as torch.distributed.checkpoint wants them
    (full names, DTensor shards; optimizer states initialized so that a load has a target)."""
    import torch
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    module = next((v for v in big.values() if isinstance(v, torch.nn.Module)), None)
    out: dict[str, Any] = {}
    for name, obj in big.items():
        if isinstance(obj, torch.nn.Module):
            out[name] = get_model_state_dict(obj)
        else:
            assert module is not None  # split_sharded refused optimizers without one module
            out[name] = get_optimizer_state_dict(module, obj)
    return out


def load_sharded_state(big: Mapping[str, Any], loaded: Mapping[str, Any]) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    module = next((v for v in big.values() if isinstance(v, torch.nn.Module)), None)
    for name, obj in big.items():
        if isinstance(obj, torch.nn.Module):
            set_model_state_dict(obj, loaded[name])
        else:
            assert module is not None
            set_optimizer_state_dict(module, obj, loaded[name])


def write_shards(big: Mapping[str, Any], directory: Path, rank: int, rng: Any) -> None:
    """This rank's part of a sharded checkpoint: its shards (a collective) and its RNG."""
    dcp = _module("torch.distributed.checkpoint")
    if big:
        with _single_process_quietly():
            dcp.save(
                sharded_state(big), checkpoint_id=str(directory), no_dist=process_group() is None
            )
    directory.mkdir(exist_ok=True)  # no module or optimizer: DCP made none
    write_rank_rng(directory, rank, rng)


def write_rank_rng(directory: Path, rank: int, rng: Any) -> None:
    """This rank's random states into ``directory`` (which must exist: a directory removed by
    a failed commit is not made again)."""
    with open(directory / f"rng-{rank}.pt", "wb") as fh:
        fh.write(pack(rng))
        fh.flush()
        os.fsync(fh.fileno())


_NO_DIST_SAVE = (
    "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save"
)


class BackgroundShards:
    """Sharded saves in the background: ``torch.distributed.checkpoint.async_save``.

    DCP copies the shards to host memory on the calling thread (into buffers its stager keeps
    from save to save; page-locked when the state has CUDA tensors) and writes them in a thread
    of its own, where the ranks plan and finish the checkpoint with collectives. Those
    collectives run on a gloo group of ours, created here on every rank (a collective itself:
    every rank creates its handler at the same point), so they never interleave with the
    training loop's own collectives on the default group, and a CPU backend is there even when
    training uses NCCL (DCP's async_save requires one, even for a group of one rank). The
    group's timeout is the ranks' (``PREEMPTIBLE_DIST_TIMEOUT``): a rank that died mid-save
    fails the others' background saves instead of hanging them. Without torch.distributed
    (one process, ``sharded=True``) DCP saves without collectives.

    The copies are blocking: DCP's non-blocking mode synchronizes only the current CUDA device
    before its thread writes, and a state on another device could be written before its copy
    landed (a checkpoint mixing two steps).
    """

    def __init__(self, timeout: float) -> None:
        self._stager: Any = None  # made at the first save, when the state's devices are known
        self._group = None
        torch = sys.modules.get("torch")
        dist = getattr(torch, "distributed", None) if torch is not None else None
        if dist is not None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=timeout)
            )
        else:
            # DCP's background thread warns on every save without a process group, which is
            # meant here; a filter of the calling thread (catch_warnings) would not reach it
            warnings.filterwarnings("ignore", message=_NO_DIST_SAVE)

    def start(self, big: Mapping[str, Any], directory: Path) -> Any:
        """Snapshot ``big``'s shards now; a future that is done when every rank wrote them into
        ``directory`` (DCP's ``.metadata`` included)."""
        dcp = _module("torch.distributed.checkpoint")
        if not big:
            done: Future[None] = Future()
            done.set_result(None)
            return done
        state = sharded_state(big)
        if self._stager is None:
            staging = _module("torch.distributed.checkpoint.staging")
            self._stager = staging.DefaultStager(
                staging.StagingOptions(
                    use_pinned_memory=_has_cuda_tensor(state),
                    use_shared_memory=False,
                    use_async_staging=False,  # the copy is the snapshot: done before we go on
                    use_non_blocking_copy=False,
                )
            )
        with _single_process_quietly():
            return dcp.async_save(
                state,
                checkpoint_id=str(directory),
                process_group=self._group,
                async_stager=self._stager,
                no_dist=self._group is None,
            )

    def close(self) -> None:
        """Free the staging buffers and the group (after the last save finished)."""
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(Exception):  # the default group may be gone already
                _module("torch.distributed").destroy_process_group(group)


def _has_cuda_tensor(value: Any) -> bool:
    torch = sys.modules["torch"]
    if isinstance(value, torch.Tensor):
        return bool(value.device.type == "cuda")  # a DTensor's is its local shard's
    if isinstance(value, Mapping):
        return any(_has_cuda_tensor(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_cuda_tensor(v) for v in value)
    return False


def read_shards(big: Mapping[str, Any], directory: Path) -> None:
    dcp = _module("torch.distributed.checkpoint")
    if big:
        target = sharded_state(big)
        with _single_process_quietly():
            dcp.load(target, checkpoint_id=str(directory), no_dist=process_group() is None)
        load_sharded_state(big, target)


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """DCP warns on every save and load without a process group, which is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_rank_rng(directory: Path, rank: int) -> dict[str, Any]:
    path = directory / f"rng-{rank}.pt"
    if not path.exists():
        logger.warning("preemptible: %s has no random states of rank %d; kept", directory, rank)
        return {}
    value = unpack(path.read_bytes())
    return value if isinstance(value, dict) else {}


def check_sharded(directory: Path) -> None:
    """Raise unless ``directory`` is a complete sharded checkpoint (cheap: no shard is read)."""
    if not (directory / META_NAME).is_file() or not (directory / ".metadata").is_file():
        raise CheckpointLoadError(
            f"{directory} is not a complete sharded checkpoint (no {META_NAME} or .metadata)",
            directory,
        )
    _module("torch.distributed.checkpoint").FileSystemReader(str(directory)).read_metadata()


class Subset(MutableMapping[str, Any]):
    """The user's state without the entries a sharded checkpoint writes through DCP; writes go
    through to the user's mapping (plain values restored on resume land where they belong)."""

    def __init__(self, mapping: Mapping[str, Any], without: set[str]) -> None:
        self._mapping = mapping
        self._without = without

    def __getitem__(self, key: str) -> Any:
        if key in self._without:
            raise KeyError(key)
        return self._mapping[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(self._mapping, MutableMapping):
            raise TypeError("the state mapping is not mutable")
        self._mapping[key] = value

    def __delitem__(self, key: str) -> None:  # pragma: no cover - never called by preemptible
        raise TypeError("preemptible does not delete state entries")

    def __iter__(self) -> Iterator[str]:
        return (k for k in self._mapping if k not in self._without)

    def __len__(self) -> int:
        return sum(1 for _ in self)


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
