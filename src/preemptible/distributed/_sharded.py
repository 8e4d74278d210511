"""Sharded checkpoints: every rank writes its shards through ``torch.distributed.checkpoint``.

Every rank writes into one temporary directory chosen by rank 0, which adds the small state
(``preemptible.pt``: the step, plain values, objects that are not modules or optimizers) and
renames the directory into place once every rank has written: the commit protocol of a file.
In the background (``async_save=True``) the same directory is written by DCP's ``async_save``
(``BackgroundShards``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from .._errors import CheckpointLoadError, ConfigError
from .._torch import initialized_dist
from ..checkpoint._payload import without_crc32
from ._group import pack, process_group, torch_module, unpack

logger = logging.getLogger("preemptible")
# -- sharded checkpoints -----------------------------------------------------------------------

META_NAME = "preemptible.pt"
"""Rank 0's part of a sharded checkpoint: step, small objects, plain values, RNG of every rank."""


def has_dtensor(objects: Mapping[str, Any]) -> bool:
    """Whether any module of ``objects`` has DTensor parameters (FSDP2, tensor parallel).

    A DTensor exists only once its package is imported, and importing it (sympy with it, 470
    modules) would cost every single-process run 0.5 s at its start and some 20 ms at each
    exit, its stop's included: without the package in ``sys.modules`` there is none."""
    torch = sys.modules.get("torch")
    tensor = sys.modules.get("torch.distributed.tensor")
    if torch is None or tensor is None:
        return False
    DTensor = getattr(tensor, "DTensor", None)
    if DTensor is None:  # pragma: no cover - still being imported
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
    dcp = torch_module("torch.distributed.checkpoint")
    if big:  # DCP torch.saves each item: without the CRC nothing reads, as a payload is
        with _single_process_quietly(), without_crc32():
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
        dist = initialized_dist()
        if dist is not None:
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
        dcp = torch_module("torch.distributed.checkpoint")
        if not big:
            done: Future[None] = Future()
            done.set_result(None)
            return done
        state = sharded_state(big)
        if self._stager is None:
            staging = torch_module("torch.distributed.checkpoint.staging")
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
                torch_module("torch.distributed").destroy_process_group(group)


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
    dcp = torch_module("torch.distributed.checkpoint")
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
    torch_module("torch.distributed.checkpoint").FileSystemReader(str(directory)).read_metadata()


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
