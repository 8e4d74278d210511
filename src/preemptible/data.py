"""A data position that resumes mid-epoch: torch's DistributedSampler, able to start part-way.

A resumed run knows its step, and with a fixed number of batches per epoch the data position
is a function of it: ``epoch, batch = divmod(step, batches_per_epoch)``. torch's
``DistributedSampler`` reshuffles each epoch by ``seed + epoch`` but always starts it at its
first index and has no ``state_dict()``, so a run resumed in the middle of an epoch either
trains that epoch's first batches twice or loads them again only to drop them.
``ResumableDistributedSampler.set_epoch(epoch, skip=n)`` starts that epoch at this rank's
n-th index instead: nothing before it is loaded, and every index after it is the one the
uninterrupted epoch had there, on every rank.

It covers a map-style dataset read through a ``DataLoader`` with this sampler (any batch
size, ``num_workers``, ``drop_last``, shuffled or not): the sampler runs in the main process,
the workers only load what it yields. An ``IterableDataset`` has no sampler: use a loader
with ``state_dict()`` (torchdata's ``StatefulDataLoader``) in the handler's ``state``.

Importing this module imports torch; ``import preemptible`` does not.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TypeVar

from torch.utils.data import Dataset, DistributedSampler

from ._errors import ConfigError
from ._torch import initialized_dist

__all__ = ["ResumableDistributedSampler"]

T_co = TypeVar("T_co", covariant=True)


class ResumableDistributedSampler(DistributedSampler[T_co]):
    """``torch.utils.data.DistributedSampler`` whose ``set_epoch`` can skip into the epoch.

    ``set_epoch(epoch, skip=n)``: iterating the sampler yields this rank's indices of
    ``epoch`` from the n-th on (for a DataLoader of batch size B, ``skip=batch * B`` starts at
    batch ``batch``); the skip holds until the next ``set_epoch``. ``len()`` is what the
    iteration yields, so take the batches per epoch (``len(loader)``) before skipping.

    Without ``num_replicas``/``rank`` and without a process group, it is one replica (rank 0
    of 1), so the same script runs under torchrun and as a single process.
    """

    def __init__(
        self,
        dataset: Dataset[T_co],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None and rank is None and not _in_process_group():
            num_replicas, rank = 1, 0
        super().__init__(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """The epoch to shuffle for, and how many of this rank's indices of it to pass over."""
        share = self.num_samples
        if isinstance(skip, bool) or not isinstance(skip, int) or not 0 <= skip <= share:
            raise ConfigError(
                f"skip={skip!r} is not valid; use an integer from 0 to {share}, this rank's "
                "number of samples per epoch (batch index x batch size)"
            )
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[T_co]:
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return self.num_samples - self.skip


def _in_process_group() -> bool:
    return initialized_dist() is not None
